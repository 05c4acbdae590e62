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

from . import bounds, kafka
from .committer import commit_positions
from .config import OffsetBound, Pipeline
from .commitrecord import CommitRecord, Reset
from .continuity import check_owner
from .coordinates import nested
from .errors import PlanError
from .ledger import Ledger
from .preflight import table_checks
from .tables import ensure_tables


def reset(pipeline: Pipeline, to: OffsetBound, run_id: str | None = None, take_over: bool = False,
          topics: Iterable[str] = (), dry_run: bool = False) -> dict[str, Any]:
    """Sets the positions of the partitions ``to`` names (all of them but for explicit offsets) of
    ``topics`` (default: every topic of the pipeline) in both tables. An unnamed partition keeps
    each table's own position, and one without a position stays without (a run starts it as it
    would have: a new topic at ``starting_offsets``): the quarantine table's may be ahead after a
    crash between the two commits of a batch, and it is that floor which keeps its rows from being
    written twice.

    ``take_over`` lets this pipeline take the topic over in a table where another pipeline
    ingests it: the reset commits make this pipeline the owner, and the other one's runs are
    refused from then on. ``dry_run``: every check made and the positions resolved, nothing
    created or committed."""
    admin = kafka.admin_client(pipeline)
    state = kafka.describe_source(admin, pipeline)
    chosen = set(topics) or set(state.topics)
    named_topics = {t for t, _ in to.offsets if t is not None} if to.kind == "offsets" else set()
    outside = sorted((chosen | named_topics) - set(state.topics)) or sorted(named_topics - chosen)
    if outside:
        raise PlanError(f"pipeline {pipeline.name}: topic {outside[0]} is not among the ones reset "
                        f"({', '.join(sorted(chosen))}) of the pipeline's ({', '.join(state.topics)})",
                        pipeline=pipeline.name, topic=outside[0])
    log = kafka.log_bounds(admin, pipeline, state.partitions)
    options = pipeline.sink.storage_options
    main = Ledger(pipeline.sink.table_uri, pipeline.name, options)
    quarantine = Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)
    for topic in state.topics:
        check_owner(pipeline, main, main.snapshot(), topic, take_over)
    before = main.positions(state.partitions)
    reset_log = {p: b for p, b in log.items() if p.topic in chosen}
    resolved = bounds.resolve(admin, pipeline, to, reset_log, range_starts={p: None for p in reset_log},
                              default={p: None for p in reset_log})
    named = {p for p, offset in resolved.items() if offset is not None}
    for partition in sorted(named):
        if not log[partition].earliest <= resolved[partition] <= log[partition].latest:
            raise PlanError(
                f"pipeline {pipeline.name}: {partition}: cannot reset to offset {resolved[partition]}, outside the log "
                f"[{log[partition].earliest}, {log[partition].latest}]",
                pipeline=pipeline.name, topic=partition.topic, partition=partition.partition,
                offset=resolved[partition],
            )
    target = {p: resolved[p] if p in named else before[p] for p in log}
    quarantine_before = quarantine.positions(state.partitions)
    quarantine_target = {p: target[p] if p in named else quarantine_before[p] for p in log}
    schema = _table_schema(pipeline, main, state.topics)
    if dry_run:  # the tables' checks a reset would make, read-only
        failed = [c for c in table_checks(pipeline) if not c.ok]
        if failed:
            raise PlanError(f"pipeline {pipeline.name}: {failed[0].what}: {failed[0].problem}; a reset would fail",
                            pipeline=pipeline.name)
        return {"pipeline": pipeline.name, "topics": state.topics, "from": before, "to": target, "versions": {}}
    ensure_tables(pipeline, schema)
    run_id = run_id or f"oncemore-reset-{uuid.uuid4().hex[:12]}"
    versions = {}
    # Main table first: a crash before the quarantine commit leaves the quarantine table's floor
    # where it was, which only ever keeps a quarantine row from being written twice.
    for ledger, was, now in ((main, before, target), (quarantine, quarantine_before, quarantine_target)):
        moved = {p: v for p, v in now.items() if v is not None}
        record = CommitRecord(
            pipeline=pipeline.name, run_id=run_id, until=to.describe(),
            topic_ids={t: i.topic_id for t, i in sorted(state.identities.items())},
            cluster_id=next(iter(state.identities.values())).cluster_id,
            reset=Reset(from_positions=nested(was), to_positions=nested(moved), to=to.describe()),
        )
        versions[ledger.table_uri] = commit_positions(ledger, moved, record, take_over)
    return {"pipeline": pipeline.name, "topics": state.topics, "from": before, "to": target, "versions": versions}


def _table_schema(pipeline: Pipeline, main: Ledger, topics: list[str]):
    """The main table's schema: the table's own, or for a table still to create, the records'."""
    from .evolution import arrow_schema
    from .recordformat import registries, resolve

    table = main.snapshot()
    if table is not None:
        from pyspark.sql.types import StructType

        return arrow_schema(StructType.fromJson(json.loads(table.schema().to_json())))
    if pipeline.shapes_in_spark:
        raise PlanError(f"pipeline {pipeline.name}: table {pipeline.sink.table_uri} does not exist yet and its "
                        "transform makes its schema: run the pipeline once (or reset after the first run)",
                        pipeline=pipeline.name)
    return resolve(pipeline, topics).schema(*registries(pipeline))
