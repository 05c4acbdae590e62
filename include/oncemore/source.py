"""Spark Python Data Source ``oncemore_kafka``: reads exact Kafka offset ranges as Arrow batches.

Options follow Spark's Kafka source: ``topic``, ``startingOffsets`` and ``endingOffsets`` as
``{"topic": {"0": 42}}``, ``kafka.<librdkafka setting>``, ``maxRecordsPerPartition``; plus
``stallTimeoutMs`` and ``pipeline`` (named in errors). Columns are the Kafka source's:
key, value, topic, partition, offset, timestamp, timestampType (headers are not read).

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

from .schema import KAFKA_RECORD_DDL, KAFKA_RECORD_SCHEMA, TIMESTAMP

NAME = "oncemore_kafka"
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

    def schema(self) -> str:
        return KAFKA_RECORD_DDL

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
        yield from read_range(
            self.kafka_config, split.topic, split.partition, split.start, split.end, self.stall_timeout, self.pipeline
        )


def read_range(
    kafka_config: dict, topic: str, partition: int, start: int, end: int, stall_timeout: float, pipeline: str = "?"
) -> Iterator[pa.RecordBatch]:
    """Records of ``topic/partition`` in [start, end) as Arrow batches of KAFKA_RECORD_SCHEMA."""
    from confluent_kafka import Consumer, TopicPartition

    where = f"pipeline {pipeline}: {topic}/{partition}"
    consumer = Consumer(kafka_config)
    tp = TopicPartition(topic, partition, start)
    try:
        consumer.assign([tp])
        position, last_progress = start, time.monotonic()
        pending: list = []
        while position < end:
            messages = consumer.consume(num_messages=min(ARROW_BATCH_ROWS, 10_000), timeout=_POLL_SECONDS)
            for message in messages:
                if message.error() is not None:
                    raise KafkaReadError(f"{where}: read failed near offset {position}: {message.error()}")
            if messages and messages[-1].offset() >= end:
                messages = [m for m in messages if m.offset() < end]
                new_position = end
            else:
                new_position = messages[-1].offset() + 1 if messages else position
                # Transaction markers (and aborted records) advance the position without a message.
                reported = consumer.position([TopicPartition(topic, partition)])[0].offset
                new_position = max(new_position, reported)
            if messages and messages[0].offset() < position:
                raise KafkaReadError(
                    f"{where}: broker returned offset {messages[0].offset()} before position {position}"
                )
            pending += messages
            if new_position > position:
                position, last_progress = new_position, time.monotonic()
            elif time.monotonic() - last_progress > stall_timeout:
                raise KafkaReadError(
                    f"{where}: no progress for {stall_timeout:.0f}s at offset {position} of range "
                    f"[{start}, {end}): the records are missing from the broker (deleted, or the topic was recreated)"
                )
            if len(pending) >= ARROW_BATCH_ROWS:
                yield to_record_batch(topic, partition, pending)
                pending = []
        if pending:
            yield to_record_batch(topic, partition, pending)
    finally:
        consumer.close()


def to_record_batch(topic: str, partition: int, messages: list) -> pa.RecordBatch:
    count = len(messages)
    stamps = [m.timestamp() for m in messages]
    millis = pa.array([t[1] if t[0] else None for t in stamps], pa.int64())
    return pa.RecordBatch.from_arrays(
        [
            pa.array([m.key() for m in messages], pa.binary()),
            pa.array([m.value() for m in messages], pa.binary()),
            pa.DictionaryArray.from_arrays(np.zeros(count, np.int32), pa.array([topic])).cast(pa.string()),
            pa.array(np.full(count, partition, np.int32)),
            pa.array([m.offset() for m in messages], pa.int64()),
            pc.multiply(millis, 1000).cast(TIMESTAMP),
            pa.array([_SPARK_TIMESTAMP_TYPE.get(t[0], -1) for t in stamps], pa.int32()),
        ],
        schema=KAFKA_RECORD_SCHEMA,
    )
