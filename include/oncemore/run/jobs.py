"""The Spark work of one part of a batch, in one of two shapes (DESIGN.md):

- ``ingest_job``: records stay in Python (no transform, no expectations). One job whose tasks
  (kafkasource.IngestTasks) read, decode and write both tables' files; the RangeResults come back
  through ``collect`` and the run commits them (commit/part.py).
- ``shaped_job``: records go through Spark. The records' DataFrame (kafkasource.RecordsTasks),
  shaped by the transform and the expectations (transform.py), written by the sink's tasks
  (deltasink.SinkTasks), whose files come back through ``collect``, with the reading tasks'
  RangeResults through the part's staging area (staging.py); the run commits them alike (an
  upsert whose MERGE runs on the cluster with the cluster's rewrite, rewritejob.py).

Either way the reading is a ``mapInArrow`` over one row per task (the sink's, over the shaped
rows), planned by the JVM alone, and the part's commits are made in the run's own process: wherever its Spark runs (local, a cluster, a
Spark Connect server), no commit is made anywhere else.

A job that fails names the ranges of the task that failed where Spark names the task's index
(the index of its group of ranges in the reading stage: a dead Python worker), else every range
of the job, and the cause; an error a task raises names its own range (kafka/, decode/).
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Callable

from oncemore.commit.inputs import Part, RangeResult
from oncemore.commit.part import PartOutcome, Written
from oncemore.config.model import Pipeline, PythonTransform
from oncemore.core import hours
from oncemore.core.coordinates import KafkaPartition, OffsetRange
from oncemore.core.errors import TaskFailed, root_cause
from oncemore.kafka.clients import consumer_config
from oncemore.run.staging import Staging
from oncemore.run.tasks import TaskSpec
from oncemore.shape.transform import reads_records
from oncemore.write.files import DataFile

log = logging.getLogger("oncemore")


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
               shape: Callable, commit: Callable[..., PartOutcome]) -> PartOutcome:
    """The part's records read by ``RecordsTasks``, shaped by ``shape``, written by ``SinkTasks``
    (one Spark job), then committed by ``commit(results, written, cluster)``: the reading tasks'
    RangeResults (from the part's staging area), the sink tasks' Written, and for an upsert whose
    MERGE runs on the cluster its ClusterRewrite (else None). The staging area, which also holds an
    upsert's change rows, is removed once ``commit`` returns or anything fails."""
    from oncemore.run.deltasink import SinkTasks, WrittenFiles
    from oncemore.run.kafkasource import records_frame, records_schema

    staging = Staging(part.quarantine_uri, part.staging_id, spec.storage_options)
    try:
        options = {**reading_options(pipeline, spec, groups, budget), "staging": part.staging_id}
        # A transform in Python may hold pandas UDFs, which run in the same workers as oncemore's functions.
        without_pandas = not isinstance(pipeline.transform, PythonTransform)
        records = records_frame(spark, options, records_schema(spec), without_pandas)
        shaped = shape(records)
        keeps_rows = reads_records(shaped)
        if not keeps_rows:
            # Spark proved the transform keeps no row and would skip reading: the records are read all
            # the same, so bad ones reach the quarantine table and the rest are counted as filtered.
            log.info("pipeline %s: the transform keeps no record (Spark folds it to nothing); reading the records "
                     "for the quarantine table only", pipeline.name)
            shaped = records
        expectations = [{"name": e.name, "on_fail": e.on_fail} for e in pipeline.expectations] if keeps_rows else []
        write = SinkTasks(part, spec.table_schema, expectations, keeps_rows, spec.quarantine_floors,
                          spec.storage_options, without_pandas)
        try:
            rows = shaped.mapInArrow(write, "written string").collect()
        except Exception as exc:  # a task's error, or its Python worker died
            raise task_failure(exc, pipeline.name, groups) from exc
        results = _one_per_range(RangeResult.from_json(text) for text in staging.get("range-"))
        cluster = None
        if part.merges_on_cluster:
            from oncemore.run.rewritejob import cluster_rewrite

            cluster = cluster_rewrite(spark, part, spec.storage_options)
        return commit(results, _written([WrittenFiles.from_json(row["written"]) for row in rows]), cluster)
    finally:
        staging.remove()


def _written(messages: list) -> Written:
    """The sink tasks' WrittenFiles as one Written."""
    return Written(
        files=tuple(DataFile.from_dict(f) for m in messages for f in m.files),
        violations=sum((Counter(m.violations) for m in messages), Counter()),
        violations_by_partition={KafkaPartition.parse(k): v for k, v in
                                 sum((Counter(m.violations_by_partition) for m in messages), Counter()).items()},
        write_seconds=sum(m.write_seconds for m in messages),
        hours=hours.merged(*(m.hours or {} for m in messages)),
    )


def _one_per_range(results) -> list[RangeResult]:
    """One RangeResult per range: a retried or speculative task attempt left another (both read the
    same records); the other's files are never committed (vacuum removes them). A task's ranges
    share its files, listed by its last range's result (tasks.TaskFiles): whichever attempt's
    results are chosen, each range's rows are in exactly one chosen file, as attempts read the same
    records (a file holding offsets past its range's chosen end fails validation, never commits)."""
    chosen: dict[tuple, RangeResult] = {}
    for result in sorted(results, key=lambda r: (r.topic, r.partition, r.start, r.reached)):
        chosen.setdefault((result.topic, result.partition, result.start), result)
    return list(chosen.values())


def task_failure(exc: BaseException, pipeline: str, groups: list[list[OffsetRange]]) -> TaskFailed:
    """A failed Spark job as one line naming the ranges of the task that failed (Spark names its
    index, which is the group's in the reading stage), else of every task."""
    found = re.search(r"Task (\d+) in stage [\d.]+ failed", str(exc))
    failed = [groups[int(found.group(1))]] if found and int(found.group(1)) < len(groups) else groups
    ranges = [r for group in failed for r in group]
    return TaskFailed(f"pipeline {pipeline}: the Spark task reading {', '.join(map(str, ranges))} failed: {root_cause(exc)}",
                      ranges=[str(r) for r in ranges])

