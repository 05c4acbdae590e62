"""A routed pipeline's recent history as the parts it committed: each of its tables commits its own
share of a part (commit/routed.py), so what ``status`` and the oncemore page show per batch (its
ranges, records written, quarantined and unrouted, its rows by the hour) is those commits taken
together, one entry per (run, batch) of the tables' recent commits.

Read-only, from the tables' recent history only (each table's newest ``limit`` commits), as for a
pipeline of one table.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from oncemore.core import hours
from oncemore.core.coordinates import flat, nested
from oncemore.plan.commitinfo import CommitEntry
from oncemore.plan.ledger import Ledger
from oncemore.plan.tables import QUARANTINE


def routed_batches(ledgers: Mapping[str, Ledger], limit: int | None) -> tuple[list[CommitEntry], list[dict[str, int]]]:
    """The parts among the tables' newest ``limit`` commits, newest first, each as one CommitEntry
    (its version the quarantine table's commit of it where there is one, its time the newest of its
    commits, its ranges the union of its commits', its counts their sum), and beside each, by tag,
    the versions of the commits it was made of. A reset's or a deletion's commits are each table's
    own and stay apart."""
    groups: dict[tuple, list[tuple[str, CommitEntry]]] = {}
    for tag, ledger in ledgers.items():
        for entry in ledger.recent_batches(limit):
            record = entry.record
            key = (record.run_id, record.batch_seq, tag, entry.version) if record.reset or record.deletion else \
                (record.run_id, record.batch_seq)
            groups.setdefault(key, []).append((tag, entry))
    merged = []
    for commits in groups.values():
        newest = max(commits, key=lambda c: c[1].timestamp_ms)[1]
        quarantine = next((e for tag, e in commits if tag == QUARANTINE), None)
        spans: dict = {}
        for _, entry in commits:
            for p, (start, end) in entry.record.partition_ranges().items():
                low, high = spans.get(p, (start, end))
                spans[p] = (min(low, start), max(high, end))
        records: dict[str, int] = {}
        for _, entry in commits:
            for name, count in entry.record.records.items():
                records[name] = records.get(name, 0) + count
        record = replace(newest.record, ranges=nested({p: list(r) for p, r in spans.items()}), records=records,
                         hours=hours.merged(*(e.record.hours for _, e in commits)), route=None,
                         duration_ms=max(e.record.duration_ms for _, e in commits),
                         log_end=nested({p: end for _, e in commits for p, end in flat(e.record.log_end).items()}))
        merged.append((CommitEntry((quarantine or newest).version, newest.timestamp_ms, record),
                       {tag: e.version for tag, e in commits}))
    merged.sort(key=lambda m: m[0].timestamp_ms, reverse=True)
    return [entry for entry, _ in merged], [versions for _, versions in merged]

