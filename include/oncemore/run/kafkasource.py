"""How Spark reads exact Kafka offset ranges: a Python Data Source, and the functions of a run's
jobs.

``oncemore_kafka`` yields the records as Arrow batches with the Spark Kafka source's columns:
key, value, topic, partition, offset, timestamp, timestampType (headers are not read). Use it
to look at a range in Spark, registered first (``spark.dataSource.register(KafkaRangeDataSource)``).
Options follow Spark's Kafka source: ``startingOffsets`` and ``endingOffsets`` as
``{"topic": {"0": 42}}``, ``kafka.<librdkafka setting>``, ``maxRecordsPerPartition``; plus
``stallTimeoutMs`` and ``pipeline`` (named in errors).

What runs read (``TaskRanges``): option ``tasks`` lists the Spark tasks, each a list of ranges
``[[topic, partition, start, end], ...]`` (planner.group_tasks), read in turn, each stopped at
``maxBytesPerTask`` key + value bytes; ``spec`` carries the tasks.TaskSpec as JSON and
``storage.<KEY>``, ``registry.<key>``, ``key.registry.<key>`` its settings. Both functions run as
``mapInArrow`` over one row per task, its index (run/jobs.py):
- ``IngestTasks``: records stay in Python. Each range is decoded and written to the task's files
  of both tables, and the task yields one manifest row per range (commit/inputs.py's RangeResult):
  crossing into the JVM costs ~1.1 us a record here, a third of the whole path (PLATFORM.md).
- ``RecordsTasks``: the decoded records as a DataFrame, for a transform and the sink's tasks
  (run/deltasink.py); each range's RangeResult goes to the part's staging area.

Neither is a Data Source: Spark plans one in Python processes of their own on the driver (looking
the source up, making it, planning its read), one daemon and one worker each, kept a minute idle;
that was 316 MiB of a 1 M-record run's 1,576 (docs/performance.md). The options reach the tasks
inside the function, which Spark shows by name only (as run/rewritejob.py's) and oncemore's
sessions never write to a file (session.py). Spark plans ``oncemore_kafka``'s read in such
processes, each importing this module: what only reading needs (the Kafka client, decoders,
registry clients, Arrow) is imported by the reading task, not here.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cached_property
from typing import TYPE_CHECKING, Iterator

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from oncemore.core import crashpoints
from oncemore.core.coordinates import KafkaPartition, flat, nested

if TYPE_CHECKING:
    import pyarrow as pa

    from oncemore.kafka.batches import RangeRecords
    from oncemore.run.taskspec import TaskSpec

NAME = "oncemore_kafka"


class KafkaRangePartition(InputPartition):
    """One Spark task: offsets [start, end) of one Kafka partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int):
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


def split_range(topic: str, partition: int, start: int, end: int, max_records: int) -> list[KafkaRangePartition]:
    return [
        KafkaRangePartition(topic, partition, s, min(s + max_records, end)) for s in range(start, end, max_records)
    ]


def offsets_option(offsets: dict[KafkaPartition, int]) -> str:
    """Spark's startingOffsets/endingOffsets JSON form: {"topic": {"partition": offset}}."""
    return json.dumps(nested(offsets))


def _prefixed(options, prefix: str) -> dict[str, str]:
    """The options named ``<prefix><key>``, by key (one option each, so Spark redacts by key)."""
    return {k[len(prefix):]: v for k, v in options.items() if k.startswith(prefix)}


class _ReadOptions:
    """The options every read takes: ``pipeline`` (named in errors), ``stallTimeoutMs``, ``kafka.*``."""

    def __init__(self, options):
        self.pipeline = options.get("pipeline", "?")
        self.stall_timeout = int(options.get("stallTimeoutMs", 60_000)) / 1000.0
        self.kafka_config = _prefixed(options, "kafka.")


class KafkaRangeDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        from pyspark.sql.pandas.types import from_arrow_schema

        from oncemore.kafka.batches import SPARK_KAFKA_SCHEMA

        return from_arrow_schema(SPARK_KAFKA_SCHEMA)

    def reader(self, schema) -> "KafkaRangeReader":
        return KafkaRangeReader(self.options)


class KafkaRangeReader(_ReadOptions, DataSourceReader):
    def __init__(self, options):
        super().__init__(options)
        starting = flat(json.loads(options["startingOffsets"]))
        ending = flat(json.loads(options["endingOffsets"]))
        missing = sorted(set(starting) ^ set(ending))
        if missing:
            raise ValueError(f"{missing[0]}: startingOffsets and endingOffsets must name the same partitions")
        self.ranges = sorted((key.topic, key.partition, starting[key], ending[key]) for key in starting)
        self.max_records = int(options.get("maxRecordsPerPartition", 1 << 62))

    def partitions(self) -> list[KafkaRangePartition]:
        parts = []
        for topic, partition, start, end in self.ranges:
            parts += split_range(topic, partition, start, end, self.max_records)
        return parts

    def read(self, split: KafkaRangePartition | None) -> Iterator[pa.RecordBatch]:
        if split is None:  # Spark calls read(None) once when partitions() is empty
            return
        from oncemore.kafka.batches import SPARK_KAFKA_SCHEMA, RangeRecords
        from oncemore.kafka.clients import range_consumer
        from oncemore.run.workermemory import task_memory

        with task_memory(), range_consumer(self.kafka_config, self.pipeline) as consumer:
            for batch in RangeRecords(consumer, split.topic, split.partition, split.start, split.end,
                                      self.stall_timeout, f"pipeline {self.pipeline}: {split.topic}/{split.partition}"):
                yield batch.select(SPARK_KAFKA_SCHEMA.names)


def task_spec(options) -> TaskSpec:
    """The TaskSpec of ``options`` (option ``spec``), with its settings from their own options."""
    from oncemore.run.taskspec import TaskSpec

    return TaskSpec.from_json(options["spec"], _prefixed(options, "storage."), _prefixed(options, "registry.") or None,
                              _prefixed(options, "key.registry.") or None)


class TaskRanges(_ReadOptions):
    """A run's task ranges (option ``tasks``: per Spark task, ranges [topic, partition, start,
    end]), each read up to ``maxBytesPerTask`` bytes, a task's ranges by one consumer in turn."""

    def __init__(self, options):
        super().__init__(options)
        self.tasks = [[tuple(r) for r in task] for task in json.loads(options["tasks"])]
        self.max_bytes = int(options["maxBytesPerTask"])
        self.options = dict(options)

    @cached_property
    def spec(self) -> TaskSpec:  # parsed where the ranges are read
        return task_spec(self.options)

    @cached_property
    def part_starts(self) -> dict[KafkaPartition, int]:
        """Where each partition's range of the part starts: the start of its first sub-range."""
        starts: dict[KafkaPartition, int] = {}
        for task in self.tasks:
            for topic, partition, start, _ in task:
                key = KafkaPartition(topic, partition)
                starts[key] = min(start, starts.get(key, start))
        return starts

    def ranges(self, task: list[tuple[str, int, int, int]]) -> Iterator[RangeRecords]:
        from oncemore.kafka.batches import RangeRecords
        from oncemore.kafka.fitted import FittedConsumer

        crashpoints.reach("task")
        with FittedConsumer(self.kafka_config, self.pipeline) as consumers:
            for topic, partition, start, end in task:
                records = RangeRecords(consumers.for_range(end - start), topic, partition, start, end,
                                       self.stall_timeout, f"pipeline {self.pipeline}: {topic}/{partition}",
                                       self.max_bytes, headers=self.spec.reads_headers)
                yield records
                consumers.read(records.reached - start, records.bytes_read)  # read by now: sizes the next fetches


class IngestTasks:
    """What ``mapInArrow`` runs over a run's ingest job, one row (its task's index) a Spark task:
    the task's ranges routed, decoded and written to the task's files of their tables
    (tasks.TaskFiles); one manifest row (a RangeResult) per range, in tasks.MANIFEST_SCHEMA."""

    def __init__(self, options: dict[str, str]):
        self.options = options

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from oncemore.run.workermemory import pandas_kept_out

        with pandas_kept_out():  # from before the task's imports: some make Arrow arrays at import
            from oncemore.run.tasks import ingest_ranges, manifest_batch

            tasks = TaskRanges(self.options)
            for batch in batches:
                for index in batch.column(0).to_pylist():
                    for result in ingest_ranges(tasks.ranges(tasks.tasks[index]), tasks.spec, tasks.spec.decoders(),
                                                tasks.part_starts):
                        yield manifest_batch(result)


def records_schema(spec: TaskSpec) -> pa.Schema:
    """The columns of a run's records (``RecordsTasks``): the decoded records' (decode/rows.decoded_columns),
    each taking NULL at every depth, whatever the format declares NOT NULL: a tombstone's value columns
    are NULL (its change row takes its key from the Kafka key, and no value: shape/changes.py), and
    so are a NULL struct's fields, which Arrow refused to cast to a NOT NULL field, failing the
    task on every rerun (Spark checks each batch against these columns). The probe that reads no
    record and tells the table's columns keeps what the format declares (run/prepare.py)."""
    from oncemore.core.columns import nullable
    from oncemore.decode.rows import decoded_columns

    return nullable(decoded_columns(spec.records, spec.value_registry, spec.key_registry))


def records_frame(spark, options: dict[str, str], schema: pa.Schema, without_pandas: bool = False):
    """The records of option ``tasks`` as a DataFrame of ``schema`` (records_schema), read by
    ``RecordsTasks``: the DataFrame a transform reads as the view ``records``."""
    from pyspark.sql.pandas.types import from_arrow_schema

    count = len(json.loads(options["tasks"]))
    read = RecordsTasks(options, without_pandas)
    return spark.range(0, count, 1, max(count, 1)).mapInArrow(read, from_arrow_schema(schema))


class RecordsTasks:
    """What ``mapInArrow`` runs for records that go through Spark, one row (its task's index) a
    Spark task: each range's good rows yielded, its quarantine rows written to the quarantine
    table's files, and its RangeResult put in the part's staging area (option ``staging``), where
    the run takes it after the job (run/jobs.py); without that option (``oncemore check --sample``)
    nothing is written: no RangeResult, and no quarantine row (its quarantine floors are then the
    ranges' ends). Spark's plan names it (``MapInArrow RecordsTasks(id)``): shape/transform.py
    finds there whether a transform reads the records, and how. ``without_pandas``: the job runs
    no Python but oncemore's (workermemory.pandas_kept_out)."""

    def __init__(self, options: dict[str, str], without_pandas: bool):
        self.options, self.without_pandas = options, without_pandas

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from oncemore.run.workermemory import pandas_kept_out

        with pandas_kept_out(self.without_pandas):
            tasks = TaskRanges(self.options)
            for batch in batches:
                for index in batch.column(0).to_pylist():
                    yield from self._read(tasks, tasks.tasks[index])

    def _read(self, tasks: TaskRanges, ranges: list[tuple[str, int, int, int]]) -> Iterator[pa.RecordBatch]:
        from oncemore.commit.inputs import RangeResult
        from oncemore.core.columns import nullable
        from oncemore.run.staging import Staging
        from oncemore.run.tasks import decode_ranges

        spec, staging_id = tasks.spec, self.options.get("staging")
        if staging_id is None:  # nothing written: the quarantine table "holds" every record read
            spec = replace(spec, quarantine_floors={f"{t}/{p}": end for t, p, _, end in ranges})
        staging = Staging(spec.quarantine_uri, staging_id, spec.storage_options) if staging_id else None
        decoder = spec.decoder()
        schema = nullable(decoder.schema)  # records_schema's, which Spark checks the rows against
        for item in decode_ranges(tasks.ranges(ranges), spec, decoder, tasks.part_starts):
            if isinstance(item, RangeResult):
                if staging is not None:
                    staging.put(f"range-{item.topic}-{item.partition}-{item.start}", item.to_json())
            else:
                yield from item.cast(schema).to_batches()
