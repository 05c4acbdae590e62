"""Deliberate position changes (``oncemore reset``): one commit per table recording the old and
the new positions, so the ledger shows who moved them, from where and to where.

This is the only way positions move other than by ingesting: after a topic was recreated, after
positions expired, to start a pipeline on an existing table, or to skip or re-ingest on purpose.
Re-ingesting offsets already in the table duplicates them: that is the caller's decision.
"""

from __future__ import annotations

import uuid
from typing import Any

from . import bounds, kafka
from .committer import commit_positions, ensure_tables
from .config import OffsetBound, Pipeline
from .errors import PlanError
from .ledger import CommitRecord, Ledger, Reset


def reset(pipeline: Pipeline, to: OffsetBound, run_id: str | None = None) -> dict[str, Any]:
    """Sets every partition's position in both tables to ``to`` (explicit offsets leave unnamed
    partitions where they are, or at the log start if they have no position)."""
    admin = kafka.admin_client(pipeline)
    state = kafka.describe_topic(admin, pipeline)
    log = kafka.log_bounds(admin, pipeline, state.partitions)
    topic, options = pipeline.source.topic, pipeline.sink.storage_options
    main = Ledger(pipeline.sink.table_uri, pipeline.name, topic, options)
    before = main.positions(state.partitions)
    unnamed = {p: before[p] if before[p] is not None else log[p].earliest for p in log}
    target = bounds.resolve(admin, pipeline, to, log, range_starts={p: None for p in log}, default=unnamed)
    for partition, offset in sorted(target.items()):
        if not log[partition].earliest <= offset <= log[partition].latest:
            raise PlanError(
                f"pipeline {pipeline.name}: {topic}/{partition}: cannot reset to offset {offset}, outside the log "
                f"[{log[partition].earliest}, {log[partition].latest}]",
                pipeline=pipeline.name, topic=topic, partition=partition, offset=offset,
            )
    record = CommitRecord(
        pipeline=pipeline.name, run_id=run_id or f"oncemore-reset-{uuid.uuid4().hex[:12]}", until=to.describe(),
        topic=topic, topic_id=state.identity.topic_id, cluster_id=state.identity.cluster_id,
        reset=Reset(from_positions={str(p): v for p, v in sorted(before.items())},
                    to_positions={str(p): v for p, v in sorted(target.items())}, to=to.describe()),
    )
    ensure_tables(pipeline)
    # Both tables: the quarantine table keeps only offsets at or after its own position.
    versions = {ledger.table_uri: commit_positions(ledger, target, record)
                for ledger in (main, Ledger(pipeline.sink.quarantine_uri, pipeline.name, topic, options))}
    return {"pipeline": pipeline.name, "topic": topic, "from": before, "to": target, "versions": versions}
