"""The Spark work of one part of a batch, in one of two shapes (DESIGN.md):

- ``ingest_job``: records stay in Python (no transform, no expectations). One job whose tasks
  (kafkasource.IngestTasks) read, decode and write both tables' files; the RangeResults come back
  through ``collect`` and the run commits them (commit/part.py).
- ``shaped_job``: records go through Spark. The ``oncemore_records`` source's DataFrame, shaped by
  the transform and the expectations (transform.py), written by the ``oncemore_delta`` sink, whose
  driver-side commit makes the part's commits; its outcome comes back through the staging area
  (an upsert whose MERGE runs on the cluster: the run makes them after the job, rewritejob.py).

A job that fails names the ranges of the task that failed where Spark names the task's index
(the index of its group of ranges in the reading stage: a dead Python worker), else every range
of the job, and the cause; an error a task raises names its own range (kafka/, decode/).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Callable

from oncemore.commit.inputs import Part, RangeResult
from oncemore.commit.part import PartOutcome
from oncemore.config.model import Pipeline
from oncemore.core.columns import schema_text
from oncemore.core.coordinates import OffsetRange
from oncemore.core.errors import OncemoreError, TaskFailed, error_from_json, root_cause
from oncemore.kafka.clients import consumer_config
from oncemore.run.session import register_source
from oncemore.run.staging import Staging
from oncemore.run.tasks import TaskSpec
from oncemore.shape.transform import reads_records

log = logging.getLogger("oncemore")


class PartLost(OncemoreError):
    """The sink's commit began but left no outcome: a commit of this part may or may not have landed."""


def reading_options(pipeline: Pipeline, spec: TaskSpec, groups: list[list[OffsetRange]], budget: int) -> dict[str, str]:
    """What the tasks reading ``groups`` (each the ranges one task reads) take (kafkasource.TaskRanges)."""
    options = {
        "pipeline": pipeline.name,
        "tasks": json.dumps([[[t.topic, t.partition, t.start, t.end] for t in group] for group in groups]),
        "maxBytesPerTask": str(budget),
        "stallTimeoutMs": str(int(pipeline.source.stall_timeout_seconds * 1000)),
        "spec": spec.to_json(),
    }
    settings = [("kafka.", consumer_config(pipeline)), ("storage.", spec.storage_options),
                ("registry.", spec.value_registry or {}), ("key.registry.", spec.key_registry or {})]
    for prefix, values in settings:
        options.update((f"{prefix}{key}", value) for key, value in values.items())
    return options


def source_reader(spark, source, pipeline: Pipeline, spec: TaskSpec, groups: list[list[OffsetRange]], budget: int):
    """A reader of ``source`` (a Data Source class, registered in the session) over ``groups``."""
    return spark.read.format(source.name()).options(**reading_options(pipeline, spec, groups, budget))


def ingest_job(spark, pipeline: Pipeline, spec: TaskSpec, groups: list[list[OffsetRange]], budget: int) -> list[RangeResult]:
    """The RangeResults of ``groups`` read, each group by a Spark task of one job: a ``mapInArrow``
    over one row per task, its index, which is also the index Spark names a failed task by."""
    from oncemore.run.kafkasource import IngestTasks  # imports pyspark: only once there is work to do

    read = IngestTasks(reading_options(pipeline, spec, groups, budget))
    try:
        rows = spark.range(0, len(groups), 1, len(groups)).mapInArrow(read, "range string").collect()
    except Exception as exc:  # a task's error, or its Python worker died (a crash names no offsets)
        raise task_failure(exc, pipeline.name, groups) from exc
    return [RangeResult.from_json(row["range"]) for row in rows]


def shaped_job(spark, pipeline: Pipeline, spec: TaskSpec, groups: list[list[OffsetRange]], budget: int, part: Part,
               shape: Callable) -> PartOutcome:
    from oncemore.run.deltasink import COMMIT_BEGUN, DeltaSinkDataSource, commit_left
    from oncemore.run.kafkasource import KafkaRecordsDataSource

    register_source(spark, KafkaRecordsDataSource)
    register_source(spark, DeltaSinkDataSource)
    staging = Staging(part.quarantine_uri, part.staging_id, spec.storage_options)
    records = source_reader(spark, KafkaRecordsDataSource, pipeline, spec, groups, budget).option(
        "staging", part.staging_id).load()
    shaped = shape(records)
    keeps_rows = reads_records(shaped)
    if not keeps_rows:
        # Spark proved the transform keeps no row and would skip reading: the records are read all
        # the same, so bad ones reach the quarantine table and the rest are counted as filtered.
        log.info("pipeline %s: the transform keeps no record (Spark folds it to nothing); reading the records "
                 "for the quarantine table only", pipeline.name)
        shaped = records
    expectations = [{"name": e.name, "on_fail": e.on_fail} for e in pipeline.expectations] if keeps_rows else []
    writer = (
        shaped.write.format(DeltaSinkDataSource.name()).mode("append")
        .option("part", part.to_json())
        .option("tableSchema", schema_text(spec.table_schema))
        .option("expectations", json.dumps(expectations))
        .option("keepRows", json.dumps(keeps_rows))
        .option("floors", json.dumps(spec.quarantine_floors))
    )
    for key, value in spec.storage_options.items():
        writer = writer.option(f"storage.{key}", value)
    try:
        try:
            writer.save()
        except Exception as exc:
            if not staging.get(COMMIT_BEGUN):  # a task failed, or the commit failed before committing anything
                raise task_failure(exc, pipeline.name, groups) from exc
            return _outcome(staging, pipeline, part, groups, root_cause(exc))
        if part.merges_on_cluster:
            from oncemore.run.rewritejob import cluster_rewrite

            return commit_left(part, staging, spec.table_schema, spec.storage_options,
                               cluster_rewrite(spark, part, spec.storage_options))
        return _outcome(staging, pipeline, part, groups, None)
    finally:
        staging.remove()


def _outcome(staging: Staging, pipeline: Pipeline, part: Part, groups: list[list[OffsetRange]],
             cause: str | None) -> PartOutcome:
    """What the sink's commit left: its outcome, or the error it ended with (raised here, typed as
    it was raised there), or nothing at all (it died: whether a commit landed is unknown)."""
    outcomes, failures = staging.get("outcome"), staging.get("failure")
    if outcomes:
        return PartOutcome.from_json(outcomes[0])
    ranges = ", ".join(str(r) for group in groups for r in group)
    if failures:
        error = error_from_json(failures[0])
        if error is not None:
            raise error
        cause = json.loads(failures[0])["message"]
    raise PartLost(f"pipeline {pipeline.name}: the commit of batch {part.batch_seq} ({ranges}) began and ended without "
                   f"an outcome ({cause or 'no error reported'}); a commit may have landed: run again, a rerun finds "
                   "whatever did", staging=part.staging_id, ranges=ranges)


def task_failure(exc: BaseException, pipeline: str, groups: list[list[OffsetRange]]) -> TaskFailed:
    """A failed Spark job as one line naming the ranges of the task that failed (Spark names its
    index, which is the group's in the reading stage), else of every task."""
    found = re.search(r"Task (\d+) in stage [\d.]+ failed", str(exc))
    failed = [groups[int(found.group(1))]] if found and int(found.group(1)) < len(groups) else groups
    ranges = [r for group in failed for r in group]
    return TaskFailed(f"pipeline {pipeline}: the Spark task reading {', '.join(map(str, ranges))} failed: {root_cause(exc)}",
                      ranges=[str(r) for r in ranges])

