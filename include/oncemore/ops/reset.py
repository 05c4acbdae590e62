"""Deliberate position changes (``oncemore reset``): one commit per table recording the old and
the new positions, so the ledger shows who moved them, from where and to where.

This is the only way positions move other than by ingesting: after a topic was recreated, after
positions expired, to start a pipeline on an existing table, or to skip or re-ingest on purpose.
Re-ingesting offsets already in the table duplicates them: that is the caller's decision.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, Iterable

from oncemore.commit.committer import commit_positions
from oncemore.commit.tables import ensure_tables
from oncemore.config.model import Pipeline
from oncemore.config.routes import DataTable
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import flat, nested
from oncemore.core.errors import CommitConflict, PlanError, RoutesChanged
from oncemore.kafka import clients
from oncemore.ops.check import table_checks
from oncemore.plan import bounds
from oncemore.plan.commitinfo import CommitInfo, Reset, RoutesInForce
from oncemore.plan.continuity import check_owner
from oncemore.plan.ledger import Ledger
from oncemore.plan.planner import first_offsets
from oncemore.plan.tables import Ledgers


def reset(pipeline: Pipeline, to: OffsetBound, run_id: str | None = None, take_over: bool = False,
          topics: Iterable[str] = (), dry_run: bool = False) -> dict[str, Any]:
    """Sets the positions of the partitions ``to`` names (all of them but for explicit offsets) of
    ``topics`` (default: every topic of the pipeline) in every table of the pipeline (with routes,
    each route's and the quarantine table's). Nothing else moves: every other partition keeps each
    table's own position as the snapshot the reset commits on holds it (a run committing meanwhile
    is kept, not undone), and a table's may be ahead after a crash between the commits of a batch,
    which is the floor that keeps its rows from being written twice. A topic that has no position yet gets its first ones from the reset: the
    partitions it does not name start where a run would have started them (``starting_offsets``).

    The reset is decided on the positions it reads first; if the snapshot it commits on holds
    others for a partition it moves (a run committed meanwhile), it commits nothing and fails
    (CommitConflict), so its record always states the positions it really moved from.

    ``take_over`` lets this pipeline take ``topics`` over in a table where another pipeline ingests
    them: the reset commits make this pipeline their owner, and the other one's runs are refused
    from then on; topics not reset are left to their owners. ``dry_run``: every check made and the
    positions resolved, nothing created or committed."""
    admin = clients.admin_client(pipeline)
    state = clients.describe_source(admin, pipeline)
    chosen = set(topics) or set(state.topics)
    named_topics = {t for t, _ in to.offsets if t is not None} if to.kind == "offsets" else set()
    outside = sorted((chosen | named_topics) - set(state.topics)) or sorted(named_topics - chosen)
    if outside:
        raise PlanError(f"pipeline {pipeline.name}: topic {outside[0]} is not among the ones reset "
                        f"({', '.join(sorted(chosen))}) of the pipeline's ({', '.join(state.topics)})",
                        pipeline=pipeline.name, topic=outside[0])
    log = clients.log_bounds(admin, pipeline, [p for p in state.partitions if p.topic in chosen])
    ledgers = Ledgers(pipeline)
    for ledger in ledgers.by_tag().values():
        table = ledger.snapshot()
        for topic in sorted(chosen):
            check_owner(pipeline, ledger, table, topic, take_over)
    seen = ledgers.positions(log)
    resolved = bounds.resolve(admin, pipeline, to, log, range_starts={p: None for p in log},
                              default={p: None for p in log})
    named = {p: offset for p, offset in resolved.items() if offset is not None}
    for partition, offset in sorted(named.items()):
        if not log[partition].earliest <= offset <= log[partition].latest:
            raise PlanError(
                f"pipeline {pipeline.name}: {partition}: cannot reset to offset {offset}, outside the log "
                f"[{log[partition].earliest}, {log[partition].latest}]",
                pipeline=pipeline.name, topic=partition.topic, partition=partition.partition, offset=offset,
            )
    # A topic's first positions are recorded for all its partitions at once (as a run's first
    # batch does): afterwards a partition without one is taken for one added to the topic later.
    # (In a quarantine table that only keeps rows they stay without: its position is only ever a floor.)
    new_topics = {p.topic for p in log} - {p.topic for p, v in seen.items() if v is not None}
    unnamed = {p: b for p, b in log.items() if p.topic in new_topics and p not in named}
    target = {**named, **first_offsets(admin, pipeline, {}, unnamed)}
    planning = ledgers.planning()
    moves = {}
    for tag, ledger in ledgers.by_tag().items():
        wanted = target if tag in planning else named
        was = ledger.positions(wanted)
        # A table's position only rewinds with the pipeline's (a deliberate replay): moved forward, or
        # to where the pipeline stands, it keeps a position that is ahead (a crash between a part's
        # commits), or its rows from the target to that position would be written again.
        moves[ledger] = (was, {p: t if seen[p] is not None and t < seen[p] else max(t, t if was[p] is None else was[p])
                               for p, t in wanted.items()})
    routes = _routes_after(pipeline, ledgers, state.partitions, target) if ledgers.routed else None
    schemas = {tag: _table_schema(pipeline, table, ledger, state.topics) for tag, (table, ledger) in ledgers.data.items()}
    if dry_run:  # the tables' checks a reset would make, read-only
        failed = [c for c in table_checks(pipeline) if not c.ok]
        if failed:
            raise PlanError(f"pipeline {pipeline.name}: {failed[0].what}: {failed[0].problem}; a reset would fail",
                            pipeline=pipeline.name)
        return {"pipeline": pipeline.name, "topics": state.topics, "from": {p: seen[p] for p in target},
                "to": target, "versions": {}}
    ensure_tables(pipeline, schemas)
    run_id = run_id or f"oncemore-reset-{uuid.uuid4().hex[:12]}"
    versions = {}
    # The data tables first, the quarantine table last: a crash before the quarantine commit of a
    # pipeline without routes leaves its floor where it was, which only ever keeps a quarantine row
    # from being written twice.
    for ledger, (was, now) in moves.items():
        record = CommitInfo(
            pipeline=pipeline.name, run_id=run_id, until=to.describe(),
            # The IDs of the topics reset only: another topic's positions keep the identity they
            # were committed for (a recreated one among them stays refused until reset itself).
            topic_ids={t: i.topic_id for t, i in sorted(state.identities.items()) if t in chosen},
            cluster_id=next(iter(state.identities.values())).cluster_id,
            reset=Reset(from_positions=nested(was), to_positions=nested(now), to=to.describe()),
            routes=routes if ledger is ledgers.quarantine else None,
        )
        try:
            versions[ledger.table_uri] = commit_positions(ledger, now, record, seen=was, partitions=state.partitions,
                                                          take_over=take_over)
        except CommitConflict as conflict:
            if not versions:
                raise
            done = ", ".join(f"{uri} version {v}" for uri, v in versions.items())
            raise CommitConflict(f"{conflict} (the reset of {done} landed: the same reset again sets the other "
                                 "tables')", **conflict.evidence) from None
    return {"pipeline": pipeline.name, "topics": state.topics, "from": {p: seen[p] for p in target}, "to": target,
            "versions": versions}


def _routes_after(pipeline: Pipeline, ledgers: Ledgers, partitions, target) -> RoutesInForce:
    """The routes a routed pipeline's reset commits under (plan/tables.py): the ones in force, which
    must be the pipeline file's (RoutesChanged otherwise: a table of the routes before may lack
    records a run must route first), each route's ``since`` kept for the partitions it leaves
    where they are; the tables start the ones it moves alike."""
    found = ledgers.in_force()
    if found is not None and not found.same_routes(ledgers.configured()):
        raise RoutesChanged(f"pipeline {pipeline.name}: its routes changed since its last run "
                            f"({found.changes_to(ledgers.configured())}): run it once with the new routes (or restore "
                            f"the last run's: {found.describe()}), then reset", pipeline=pipeline.name)
    record = ledgers.routes_record(partitions, {}, found)
    since = {route: nested({p: o for p, o in flat(offsets).items() if p not in target})
             for route, offsets in record.since.items()}
    return replace(record, since={route: offsets for route, offsets in since.items() if offsets})


def _table_schema(pipeline: Pipeline, table: DataTable, ledger: Ledger, topics: list[str]):
    """A data table's schema: the table's own, or for a table still to create, its records'."""
    from oncemore.commit.evolution import arrow_schema
    from oncemore.decode.resolve import registries, resolve
    from oncemore.decode.rows import decoded_columns

    found = ledger.snapshot()
    if found is not None:
        from pyspark.sql.types import StructType

        return arrow_schema(StructType.fromJson(json.loads(found.schema().to_json())))
    if pipeline.shapes_in_spark:
        raise PlanError(f"pipeline {pipeline.name}: table {table.table_uri} does not exist yet and its "
                        "transform makes its schema: run the pipeline once (or reset after the first run)",
                        pipeline=pipeline.name)
    return decoded_columns(resolve(pipeline, topics, table), *registries(pipeline))
