"""Spark Python Data Sources over exact Kafka offset ranges, one task per (partition, sub-range).

``oncemore_kafka`` yields the records as Arrow batches with the Spark Kafka source's columns:
key, value, topic, partition, offset, timestamp, timestampType (headers are not read). Use it
to look at a range in Spark.

``oncemore_ingest`` is what runs do: each task streams its range through the decoder into
Parquet files in the tables' directories and yields only the files' manifest rows. Records
never cross into the JVM: a round trip from the source to a mapInArrow stage cost more than
reading, parsing and writing together (measured: 91k rec/s that way on 2 cores).

Options follow Spark's Kafka source: ``topic``, ``startingOffsets`` and ``endingOffsets`` as
``{"topic": {"0": 42}}``, ``kafka.<librdkafka setting>``, ``maxRecordsPerPartition``; plus
``stallTimeoutMs``, ``pipeline`` (named in errors) and, for ``oncemore_ingest``, ``sink``
(a JSON TaskSpec).

Each task reads [start, end) of one partition with read_committed and stops once the consumer's
position reaches ``end``: offsets held by transaction markers, aborted or compacted records are
never delivered, so counting records would wait forever.
"""

from __future__ import annotations

import json
import time
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from .schema import KAFKA_RECORD_SCHEMA, TIMESTAMP
from .sink import MANIFEST_SCHEMA, TaskSpec, manifest_batch, write_task_files

NAME = "oncemore_kafka"
INGEST_NAME = "oncemore_ingest"
# ~50k rows per Arrow batch measured fastest into Spark (PLATFORM.md); memory stays bounded by it.
ARROW_BATCH_ROWS = 50_000
_POLL_SECONDS = 0.5
# confluent-kafka timestamp types to Spark's timestampType (0 CreateTime, 1 LogAppendTime).
_SPARK_TIMESTAMP_TYPE = {1: 0, 2: 1}


class KafkaReadError(RuntimeError):
    pass


class KafkaRangePartition(InputPartition):
    """One Spark task: offsets [start, end) of one Kafka partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int):
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


def split_range(topic: str, partition: int, start: int, end: int, max_records: int) -> list[KafkaRangePartition]:
    return [
        KafkaRangePartition(topic, partition, s, min(s + max_records, end)) for s in range(start, end, max_records)
    ]


def offsets_option(topic: str, offsets: dict[int, int]) -> str:
    """Spark's startingOffsets/endingOffsets JSON form."""
    return json.dumps({topic: {str(p): o for p, o in sorted(offsets.items())}})


class KafkaRangeDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return from_arrow_schema(KAFKA_RECORD_SCHEMA)

    def reader(self, schema) -> "KafkaRangeReader":
        return KafkaRangeReader(self.options)


class KafkaRangeReader(DataSourceReader):
    def __init__(self, options):
        self.topic = options["topic"]
        self.pipeline = options.get("pipeline", "?")
        starting = json.loads(options["startingOffsets"]).get(self.topic, {})
        ending = json.loads(options["endingOffsets"]).get(self.topic, {})
        missing = sorted(set(starting) ^ set(ending))
        if missing:
            raise ValueError(f"{self.topic}/{missing[0]}: startingOffsets and endingOffsets must name the same partitions")
        self.ranges = sorted((int(p), int(starting[p]), int(ending[p])) for p in starting)
        self.max_records = int(options.get("maxRecordsPerPartition", 1 << 62))
        self.stall_timeout = int(options.get("stallTimeoutMs", 60_000)) / 1000.0
        self.kafka_config = {k[len("kafka."):]: v for k, v in options.items() if k.startswith("kafka.")}

    def partitions(self) -> list[KafkaRangePartition]:
        parts = []
        for partition, start, end in self.ranges:
            parts += split_range(self.topic, partition, start, end, self.max_records)
        return parts

    def read(self, split: KafkaRangePartition | None) -> Iterator[pa.RecordBatch]:
        if split is None:  # Spark calls read(None) once when partitions() is empty
            return
        yield from self.records(split)

    def records(self, split: KafkaRangePartition) -> Iterator[pa.RecordBatch]:
        return read_range(
            self.kafka_config, split.topic, split.partition, split.start, split.end, self.stall_timeout, self.pipeline
        )


class KafkaIngestDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return INGEST_NAME

    def schema(self) -> StructType:
        return from_arrow_schema(MANIFEST_SCHEMA)

    def reader(self, schema) -> "KafkaIngestReader":
        return KafkaIngestReader(self.options)


class KafkaIngestReader(KafkaRangeReader):
    def __init__(self, options):
        super().__init__(options)
        self.spec = TaskSpec.from_json(options["sink"])

    def read(self, split: KafkaRangePartition | None) -> Iterator[pa.RecordBatch]:
        if split is None:
            return
        files = write_task_files(self.records(split), self.spec)
        if files:
            yield manifest_batch(files)


def read_range(
    kafka_config: dict, topic: str, partition: int, start: int, end: int, stall_timeout: float, pipeline: str = "?"
) -> Iterator[pa.RecordBatch]:
    """Records of ``topic/partition`` in [start, end) as Arrow batches of KAFKA_RECORD_SCHEMA."""
    from confluent_kafka import Consumer, TopicPartition

    where = f"pipeline {pipeline}: {topic}/{partition}"
    consumer = Consumer(kafka_config)
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        position, last_progress = start, time.monotonic()
        columns = _Columns()
        while position < end:
            messages = consumer.consume(num_messages=10_000, timeout=_POLL_SECONDS)
            if messages:
                if messages[-1].offset() >= end:
                    messages = [m for m in messages if m.offset() < end]
                    new_position = end
                else:
                    new_position = messages[-1].offset() + 1
                if messages and messages[0].offset() < position:
                    raise KafkaReadError(f"{where}: broker returned offset {messages[0].offset()} before position {position}")
                # Fields are copied out at once: read later, from many held messages, they cost ~3x more.
                columns.add(messages, where, position)
            else:
                # Transaction markers (and aborted records) advance the position without a message.
                new_position = consumer.position([TopicPartition(topic, partition)])[0].offset
            if new_position > position:
                position, last_progress = new_position, time.monotonic()
            elif time.monotonic() - last_progress > stall_timeout:
                raise KafkaReadError(
                    f"{where}: no progress for {stall_timeout:.0f}s at offset {position} of range "
                    f"[{start}, {end}): the records are missing from the broker (deleted, or the topic was recreated)"
                )
            if columns.count >= ARROW_BATCH_ROWS:
                yield columns.take_batch(topic, partition)
        if columns.count:
            yield columns.take_batch(topic, partition)
    finally:
        consumer.close()


class _Columns:
    """Column lists of the records read so far, turned into one Arrow batch at a time."""

    def __init__(self):
        self.keys, self.values, self.offsets, self.timestamps = [], [], [], []

    @property
    def count(self) -> int:
        return len(self.offsets)

    def add(self, messages: list, where: str, position: int) -> None:
        errors = [m.error() for m in messages if m.error() is not None]
        if errors:
            raise KafkaReadError(f"{where}: read failed near offset {position}: {errors[0]}")
        self.keys += [m.key() for m in messages]
        self.values += [m.value() for m in messages]
        self.offsets += [m.offset() for m in messages]
        self.timestamps += [m.timestamp() for m in messages]

    def take_batch(self, topic: str, partition: int) -> pa.RecordBatch:
        count = self.count
        millis = pa.array([t[1] if t[0] else None for t in self.timestamps], pa.int64())
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(self.keys, pa.binary()),
                pa.array(self.values, pa.binary()),
                pa.DictionaryArray.from_arrays(np.zeros(count, np.int32), pa.array([topic])).cast(pa.string()),
                pa.array(np.full(count, partition, np.int32)),
                pa.array(self.offsets, pa.int64()),
                pc.multiply(millis, 1000).cast(TIMESTAMP),
                pa.array([_SPARK_TIMESTAMP_TYPE.get(t[0], -1) for t in self.timestamps], pa.int32()),
            ],
            schema=KAFKA_RECORD_SCHEMA,
        )
        self.__init__()
        return batch
