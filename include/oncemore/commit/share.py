"""Whether a part of a batch may commit what it quarantined: the pipeline's ``quarantine`` limit,
judged on the part's own records after they are accounted for and before any of its commits (the
quarantine table's, which comes first, included).

A part fails when more than ``max_fraction`` of its records were quarantined and at least
``min_quarantined`` were (fewer never fail it: one bad record in a small batch is no reason to
stop). Its records are every record it read: written, quarantined, filtered (a transform's WHERE
is the user's intent, so a filtered record counts as handled) or unrouted and skipped; with routes,
the part as a whole, across its tables. Quarantined are records that
did not decode, rows failing an expectation whose ``on_fail`` is quarantine, rows whose partition
value a table cannot hold, and an upsert's change events that cannot be applied.

The judgement is per part, not per batch: a batch's parts commit one after another (a byte budget
or a newer writer schema cuts it), so only a part can be judged before any commit of what is judged.

Invariant: a part over its limit commits nothing in either table (its files are deleted, the
records stay in Kafka) and fails the run with QuarantineExceeded, one line naming the pipeline,
the batch, its ranges, the share, the limit, the commonest reasons and the way out; unless the run
accepts it (``oncemore run --accept-quarantine``), when it commits and its record says so.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from oncemore.core.coordinates import KafkaPartition, nested
from oncemore.core.errors import QuarantineExceeded

# The reasons a failure names, commonest first.
REASONS_SHOWN = 3
# The bytes of a quarantined value shown (the oncemore page, check --sample).
VALUE_HEAD_BYTES = 80
# A value a reason quotes (a number, or a quoted text) right after "column 'x': ", which makes each
# record's reason its own: reasons are grouped with it left out.
_QUOTED_VALUE = re.compile(r"(?<=': )(?:-?\d[\d.eE+-]*|'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")(?= )")


@dataclass(frozen=True)
class QuarantineLimit:
    """The pipeline's ``quarantine`` block for one run; ``accepted``: the run commits parts over it."""

    max_fraction: float
    min_quarantined: int
    accepted: bool = False

    def exceeded(self, quarantined: int, records: int) -> bool:
        return quarantined >= self.min_quarantined and quarantined > self.max_fraction * records


@dataclass(frozen=True)
class Reason:
    """Records quarantined for one kind of reason, and the first of them."""

    kind: str
    count: int
    first: str  # "topic/partition offset N", and the record's own reason where it quotes a value

    def describe(self) -> str:
        return f"{self.count} x {self.kind} (first: {self.first})"


def reason_kind(error: str) -> str:
    """A quarantine reason with the value it quotes left out: ``column 'amount': 12.5 does not fit
    INT`` and ``... 13.5 ...`` are one kind of reason."""
    return _QUOTED_VALUE.sub("...", error)


def commonest(rows: Iterable[tuple[str, str, int, int]], shown: int = REASONS_SHOWN) -> list[Reason]:
    """The ``shown`` commonest kinds of reason among quarantine rows (error, topic, partition,
    offset), each with its count and its first record (lowest coordinates)."""
    counts: Counter = Counter()
    first: dict[str, tuple] = {}
    for error, topic, partition, offset in rows:
        kind = reason_kind(error)
        counts[kind] += 1
        if kind not in first or (topic, partition, offset) < first[kind][:3]:
            first[kind] = (topic, partition, offset, error)
    return [Reason(kind, n, f"{topic}/{partition} offset {offset}" + (f": {error}" if error != kind else ""))
            for kind, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:shown]
            for topic, partition, offset, error in [first[kind]]]


def value_head(value: bytes | None) -> str:
    """The first bytes of a quarantined value as text, control bytes visible."""
    if value is None:
        return ""
    text = value[:VALUE_HEAD_BYTES].decode("utf-8", errors="backslashreplace")
    shown = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)
    return shown + ("…" if len(value) > VALUE_HEAD_BYTES else "")


# What every record of a part becomes: written, quarantined, filtered by a transform, unrouted (no
# route took it and the pipeline skips those), or held (a table holds it already: a crash between a
# part's commits committed it; a part's own count, never a commit's).
OUTCOMES = ("written", "quarantined", "filtered", "unrouted", "held")


def records_read(records: Mapping[str, int]) -> int:
    """Every record a part (or a commit's record) accounts for (OUTCOMES)."""
    return sum(records.get(k, 0) for k in OUTCOMES)


def describe_records(records: Mapping[str, int]) -> str:
    """An append part's counts in words."""
    text = f"{records['written']} written, {records['quarantined']} quarantined, {records['filtered']} filtered"
    return text + (f", {records['unrouted']} unrouted" if "unrouted" in records else "")


def share_text(quarantined: int, records: int) -> str:
    return f"{quarantined} of {records} records quarantined ({quarantined / records:.1%})" if records else \
        "no records"


def judge(limit: QuarantineLimit, pipeline: str, batch_seq: int, read: Mapping[KafkaPartition, tuple[int, int]],
          records: Mapping[str, int], reasons: Callable[[], list[Reason]]) -> bool:
    """Whether the part is over ``limit`` and commits because the run accepts it (its record says
    so); False for a part within it; QuarantineExceeded for one over it that is not accepted.
    ``records``: the part's accounted counts (written, quarantined, filtered); ``reasons()``: its
    commonest reasons, asked only for a part that fails."""
    total = records_read(records)
    quarantined = records.get("quarantined", 0)
    if not limit.exceeded(quarantined, total):
        return False
    if limit.accepted:
        return True
    found = reasons()
    ranges = ", ".join(f"{p} [{s}, {e})" for p, (s, e) in sorted(read.items()))
    until = json.dumps(nested({p: e for p, (_, e) in read.items()}), separators=(", ", ": "))
    named = "; ".join(r.describe() for r in found)
    raise QuarantineExceeded(
        f"pipeline {pipeline}: batch {batch_seq} ({ranges}): {share_text(quarantined, total)}, more than the limit "
        f"of {limit.max_fraction:.0%} (quarantine.max_fraction; from {limit.min_quarantined} quarantined records on); "
        f"commonest reasons: {named}. Nothing of these ranges was committed, their records stay in Kafka: fix the "
        f"pipeline and run again, or commit the batch as it is with: oncemore run {pipeline} --accept-quarantine "
        f"--until '{until}' (in Airflow: trigger the DAG with accept_quarantine true and that until)",
        pipeline=pipeline, batch=batch_seq, ranges={str(p): list(r) for p, r in sorted(read.items())},
        quarantined=quarantined, records=total, max_fraction=limit.max_fraction,
        min_quarantined=limit.min_quarantined, reasons={r.kind: r.count for r in found})
