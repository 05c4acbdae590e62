"""Deliberate position changes (``oncemore reset``): one commit per table recording the old and
the new positions, so the ledger shows who moved them, from where and to where.

This is the only way positions move other than by ingesting: after a topic was recreated, after
positions expired, to start a pipeline on an existing table, or to skip or re-ingest on purpose.
Re-ingesting offsets already in the table duplicates them: that is the caller's decision.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterable

from oncemore.commit.committer import commit_positions
from oncemore.commit.tables import ensure_tables
from oncemore.config.model import Pipeline
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import nested
from oncemore.core.errors import CommitConflict, PlanError
from oncemore.kafka import clients
from oncemore.ops.check import table_checks
from oncemore.plan import bounds
from oncemore.plan.commitinfo import CommitInfo, Reset
from oncemore.plan.continuity import check_owner
from oncemore.plan.ledger import Ledger
from oncemore.plan.planner import first_offsets


def reset(pipeline: Pipeline, to: OffsetBound, run_id: str | None = None, take_over: bool = False,
          topics: Iterable[str] = (), dry_run: bool = False) -> dict[str, Any]:
    """Sets the positions of the partitions ``to`` names (all of them but for explicit offsets) of
    ``topics`` (default: every topic of the pipeline) in both tables. Nothing else moves: every
    other partition keeps each table's own position as the snapshot the reset commits on holds it
    (a run committing meanwhile is kept, not undone), and the quarantine table's may be ahead after
    a crash between the two commits of a batch, which is the floor that keeps its rows from being
    written twice. A topic that has no position yet gets its first ones from the reset: the
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
    options = pipeline.sink.storage_options
    main = Ledger(pipeline.sink.table_uri, pipeline.name, options)
    quarantine = Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)
    table = main.snapshot()
    for topic in sorted(chosen):
        check_owner(pipeline, main, table, topic, take_over)
    seen = main.positions(log, table)
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
    # (In the quarantine table they stay without: its position is only ever a floor.)
    new_topics = {p.topic for p in log} - {p.topic for p, v in seen.items() if v is not None}
    unnamed = {p: b for p, b in log.items() if p.topic in new_topics and p not in named}
    target = {**named, **first_offsets(admin, pipeline, {}, unnamed)}
    quarantine_seen = quarantine.positions(named)
    # The quarantine table's position only rewinds with the main table's (a deliberate replay): moved
    # forward, or to where the main table's was, it keeps a floor that is ahead (a crash between a
    # batch's two commits), or its rows from the target to that floor would be written again.
    quarantine_target = {p: t if seen[p] is not None and t < seen[p] else max(t, quarantine_seen[p] or t)
                         for p, t in named.items()}
    schema = _table_schema(pipeline, main, state.topics)
    if dry_run:  # the tables' checks a reset would make, read-only
        failed = [c for c in table_checks(pipeline) if not c.ok]
        if failed:
            raise PlanError(f"pipeline {pipeline.name}: {failed[0].what}: {failed[0].problem}; a reset would fail",
                            pipeline=pipeline.name)
        return {"pipeline": pipeline.name, "topics": state.topics, "from": {p: seen[p] for p in target},
                "to": target, "versions": {}}
    ensure_tables(pipeline, schema)
    run_id = run_id or f"oncemore-reset-{uuid.uuid4().hex[:12]}"
    versions = {}
    # Main table first: a crash before the quarantine commit leaves the quarantine table's floor
    # where it was, which only ever keeps a quarantine row from being written twice.
    for ledger, was, now in ((main, {p: seen[p] for p in target}, target),
                             (quarantine, quarantine_seen, quarantine_target)):
        record = CommitInfo(
            pipeline=pipeline.name, run_id=run_id, until=to.describe(),
            # The IDs of the topics reset only: another topic's positions keep the identity they
            # were committed for (a recreated one among them stays refused until reset itself).
            topic_ids={t: i.topic_id for t, i in sorted(state.identities.items()) if t in chosen},
            cluster_id=next(iter(state.identities.values())).cluster_id,
            reset=Reset(from_positions=nested(was), to_positions=nested(now), to=to.describe()),
        )
        try:
            versions[ledger.table_uri] = commit_positions(ledger, now, record, seen=was, partitions=state.partitions,
                                                          take_over=take_over)
        except CommitConflict as conflict:
            if not versions:
                raise
            raise CommitConflict(f"{conflict} (the main table's reset landed as version {versions[main.table_uri]}: "
                                 "the same reset again sets the quarantine table's)", **conflict.evidence) from None
    return {"pipeline": pipeline.name, "topics": state.topics, "from": {p: seen[p] for p in target}, "to": target,
            "versions": versions}


def _table_schema(pipeline: Pipeline, main: Ledger, topics: list[str]):
    """The main table's schema: the table's own, or for a table still to create, the records'."""
    from oncemore.commit.evolution import arrow_schema
    from oncemore.decode.resolve import registries, resolve
    from oncemore.decode.rows import decoded_columns

    table = main.snapshot()
    if table is not None:
        from pyspark.sql.types import StructType

        return arrow_schema(StructType.fromJson(json.loads(table.schema().to_json())))
    if pipeline.shapes_in_spark:
        raise PlanError(f"pipeline {pipeline.name}: table {pipeline.sink.table_uri} does not exist yet and its "
                        "transform makes its schema: run the pipeline once (or reset after the first run)",
                        pipeline=pipeline.name)
    return decoded_columns(resolve(pipeline, topics), *registries(pipeline))
