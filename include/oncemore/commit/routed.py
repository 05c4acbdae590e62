"""A routed part's commits (config/routes.py): the quarantine table's first, then each route
table's in the pipeline's order, once the quarantine table holds its part of the range.

Every table of a routed pipeline is one of alike tables (plan/tables.py): each commits the whole
range it consumed, [its floor, the part's end) of every partition it does not hold yet (from its
own position, for a route re-added, whose records since its removal were routed by the routes of
then), with the positions of that range and a record of what in it is its own (a route table's
rows ``written``; the quarantine table's rows ``quarantined``, the records skipped as ``unrouted``
and the routes it committed under, RoutesInForce), a commit of positions alone where none of the
part's records is its. So every offset of a committed range is in exactly one route table, the
quarantine table or a commit's counted skips (DESIGN.md invariant 7), and a crash between two
tables' commits (the ``quarantine_committed`` and ``route_committed`` crash points) leaves the
tables behind to the next run, which reads from the lowest position and gives each table only the
records at or after its effective position.

Invariant: a table's commit moves its positions only from the ones its part was planned on, as
every commit does (committer.py); a table whose commit conflicts stops the part, the files of the
tables after it are deleted (never offered to a commit), and the batch goes round from the
positions as they are. A part whose routes another run's commit made stale meanwhile (plan/tables.py's
invariant, checked again at the commit) commits nothing and fails the run (RoutesChanged).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Mapping

from oncemore.commit.committer import delete_files
from oncemore.commit.inputs import Part, RangeResult, RouteTable
from oncemore.core import crashpoints, hours
from oncemore.core.columns import QUARANTINE_TAG
from oncemore.core.coordinates import KafkaPartition, by_text, nested
from oncemore.core.errors import RoutesChanged
from oncemore.core.storage import table_key
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.plan.tables import lagging, routes_changed, routes_in_force
from oncemore.write.files import DataFile

log = logging.getLogger("oncemore")


def commit_routes(part: Part, ledgers: Mapping[str, Ledger], files: Mapping[str, list[DataFile]],
                  kept: list[RangeResult], read: Mapping[KafkaPartition, tuple[int, int]], record: CommitInfo,
                  storage_options: Mapping[str, str] | None) -> tuple[str, dict[str, int], dict[str, dict[str, int]]]:
    """Commits the part's tables (module docstring); the part's status (committed when a commit
    of it is this run's), the versions it made and what its own commits added (part.files_added),
    by tag. ``files``: the part's files by tag; ``record``: the part's record, of which each
    table's commit records its own share."""
    from oncemore.commit.part import _commit, files_added  # one way to commit a table's files, part.py's

    expected = part.quarantine_expected
    quarantine = RouteTable(QUARANTINE_TAG, "", part.quarantine_uri, (), expected,
                            {p: start if expected.get(p) is None else expected[p] for p, (start, _) in read.items()})
    statuses, versions, added = [], {}, {}
    tables = [(quarantine, {"quarantined": _rows(files[QUARANTINE_TAG]), "unrouted": sum(r.unrouted for r in kept)}),
              *((route, {"written": _rows(files[route.tag])}) for route in part.routes)]
    try:
        _check_routes(part, ledgers, storage_options)
    except RoutesChanged:
        _drop(part, tables, files, storage_options)  # offered to no commit
        raise
    for i, (table, counts) in enumerate(tables):
        ranges = table.ranges(read)
        if ranges:
            own = _record(record, table, ranges, counts, [r.table_hours.get(table.tag, {}) for r in kept], part)
            outcome = _commit(part, ledgers[table.tag], files[table.tag], {p: table.expected.get(p) for p in ranges},
                              {p: end for p, (_, end) in ranges.items()}, own)
            statuses.append(outcome.status)
            if outcome.version is not None:
                versions[table.tag] = outcome.version
            if outcome.status == "committed":
                added[table.tag] = files_added(files[table.tag])
        if ranges and outcome.status == "conflict":
            _drop(part, tables[i + 1:], files, storage_options)  # never offered to a commit
            return "conflict", versions, added
        if table is quarantine:
            crashpoints.reach("quarantine_committed")
            held = ledgers[QUARANTINE_TAG].positions(read)
            short = {p: held[p] for p, (_, end) in read.items() if held[p] is None or held[p] < end}
            if short:
                log.warning("pipeline %s: the quarantine table holds %s, not the ends %s this part reached; the route "
                            "tables' commits wait, the batch goes round from the positions as they are", part.pipeline,
                            by_text(short), by_text({p: read[p][1] for p in short}))
                _drop(part, tables[1:], files, storage_options)
                return "quarantine_behind", versions, added
        else:
            crashpoints.reach("route_committed")
    status = next((s for s in ("committed", "lost_race") if s in statuses), "already_committed")
    return status, versions, added


def _check_routes(part: "Part", ledgers: Mapping[str, Ledger], storage_options) -> None:
    """plan/tables.py's invariant once more at the commit, for another run may have committed since
    the part was planned: the part's routes are the ones in force, or those are still the ones the
    part was planned under (its ``since`` was read from them) and every table of them is level;
    RoutesChanged otherwise."""
    found = routes_in_force(ledgers[QUARANTINE_TAG])
    if found is None or found.same_routes(part.routes_in_force):
        return
    if part.routes_before is None or not found.same_routes(part.routes_before):
        raise RoutesChanged(f"pipeline {part.pipeline}: another run committed under other routes ({found.describe()}) "
                            f"while batch {part.batch_seq} was read: nothing of it was committed; run again",
                            pipeline=part.pipeline)
    at_hand = {table_key(t.table_uri): ledgers[t.tag] for t in part.routes}
    gap = lagging(found, ledgers[QUARANTINE_TAG], at_hand, part.partitions, storage_options)
    if gap is not None:
        raise routes_changed(part.pipeline, found, part.routes_in_force, gap)


def _record(record: CommitInfo, table: RouteTable, ranges: Mapping[KafkaPartition, tuple[int, int]],
            counts: Mapping[str, int], table_hours: list, part: "Part") -> CommitInfo:
    """``table``'s share of the part's ``record``: the range it consumed, what in it is its own,
    the gaps its positions cross, its rows by the hour."""
    return replace(
        record, ranges=nested({p: [s, e] for p, (s, e) in ranges.items()}),
        records={"written": 0, "quarantined": 0, "filtered": 0, "unrouted": 0, **counts},
        gaps=[g for g in part.gaps if table.expected.get(KafkaPartition(g.topic, g.partition)) == g.start],
        log_end={t: {k: v for k, v in ends.items() if KafkaPartition(t, int(k)) in ranges}
                 for t, ends in record.log_end.items()},
        hours=hours.merged(*table_hours), route=table.route or None,
        routes=part.routes_in_force if table.tag == QUARANTINE_TAG else None)


def _rows(files: list[DataFile]) -> int:
    return sum(count for f in files for _, _, count in f.offsets.values())


def _drop(part: "Part", tables, files: Mapping[str, list[DataFile]], storage_options) -> None:
    for table, _ in tables:
        delete_files(table.table_uri, files[table.tag], storage_options)
