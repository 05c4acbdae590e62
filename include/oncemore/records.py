"""One task's Kafka records as Arrow batches, bounded in rows and bytes, stopping at a byte budget.

Batches carry the Spark Kafka source's columns (key, value, topic, partition, offset, timestamp,
timestampType, headers: read only when asked for, else null) plus ``timestamp_ms``, Kafka's raw
value: where it cannot be held as a microsecond timestamp (a producer stamping nanoseconds),
``timestamp`` is null and the decoder quarantines the record. A batch holds at most BATCH_ROWS rows or about BATCH_BYTES of keys and values (and
always at least one record), so a task's memory follows these bounds, not its range or the
values' size. With a byte budget the read stops after the record that reaches it; ``reached``
then says where the next read must begin (the range end when the whole range was read).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from confluent_kafka import Consumer

from .kafka import read_messages
from .schema import HEADERS_TYPE, RECORD_SCHEMA, TIMESTAMP

# ~50k rows per Arrow batch measured fastest (PLATFORM.md); bytes keep large values bounded.
BATCH_ROWS = 50_000
BATCH_BYTES = 32 << 20
# Kafka timestamps (ms) a microsecond int64 can hold.
_MAX_MS = (2**63 - 1) // 1000
# confluent-kafka timestamp types to Spark's timestampType (0 CreateTime, 1 LogAppendTime).
_SPARK_TIMESTAMP_TYPE = {1: 0, 2: 1}


class RangeRecords:
    """Iterates the Arrow batches of offsets [start, end) of one partition; afterwards ``reached``
    and ``bytes_read`` say how far the read went and how many key + value bytes it took."""

    def __init__(self, consumer: Consumer, topic: str, partition: int, start: int, end: int,
                 stall_timeout: float, where: str, max_bytes: int | None = None, headers: bool = False):
        self.consumer, self.topic, self.partition = consumer, topic, partition
        self.start, self.end, self.stall_timeout, self.where = start, end, stall_timeout, where
        self.max_bytes, self.headers = max_bytes, headers
        self.reached, self.bytes_read = start, 0

    def stop_at(self, offset: int) -> None:
        """The reader of the batches stops before ``offset`` (and leaves the loop): the range was read up to it."""
        self.reached = offset

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        columns = _Columns(self.headers)
        for messages in read_messages(self.consumer, self.topic, self.partition, self.start, self.end,
                                      self.stall_timeout, self.where):
            if self.max_bytes is not None:
                messages, stop = self._within_budget(messages)
            else:
                stop = False
            for message in messages:
                size = columns.add(message)
                self.bytes_read += size
                if columns.count >= BATCH_ROWS or columns.bytes >= BATCH_BYTES:
                    yield columns.take_batch(self.topic, self.partition)
            if stop:
                self.reached = messages[-1].offset() + 1
                break
        else:
            self.reached = self.end
        if columns.count:
            yield columns.take_batch(self.topic, self.partition)

    def _within_budget(self, messages: list) -> tuple[list, bool]:
        """The messages up to the one that reaches the byte budget (at least one), and whether it was reached."""
        total = self.bytes_read
        for i, message in enumerate(messages):
            total += _size(message)
            if total >= self.max_bytes:
                return messages[: i + 1], True
        return messages, False


def _size(message) -> int:
    return len(message.key() or b"") + len(message.value() or b"")


class _Columns:
    """Column lists of the records read so far, turned into one Arrow batch at a time."""

    def __init__(self, headers: bool):
        self.keys, self.values, self.offsets, self.stamps, self.types = [], [], [], [], []
        self.headers: list | None = [] if headers else None
        self.bytes = 0

    @property
    def count(self) -> int:
        return len(self.offsets)

    def add(self, message) -> int:
        # Fields are copied out at once: read later, from many held messages, they cost ~3x more.
        key, value = message.key(), message.value()
        kind, stamp = message.timestamp()
        self.keys.append(key)
        self.values.append(value)
        self.offsets.append(message.offset())
        self.stamps.append(stamp if kind else None)
        self.types.append(kind)
        if self.headers is not None:  # in order, repeated keys kept (Spark's includeHeaders)
            found = message.headers()
            self.headers.append([{"key": k, "value": v} for k, v in found] if found else [])
        size = len(key or b"") + len(value or b"")
        self.bytes += size
        return size

    def take_batch(self, topic: str, partition: int) -> pa.RecordBatch:
        count = self.count
        millis = pa.array(self.stamps, pa.int64())
        holdable = pc.and_(pc.greater_equal(millis, -_MAX_MS), pc.less_equal(millis, _MAX_MS))
        micros = pc.multiply(pc.if_else(holdable, millis, pa.scalar(None, pa.int64())), 1000)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(self.keys, pa.binary()),
                pa.array(self.values, pa.binary()),
                pa.DictionaryArray.from_arrays(np.zeros(count, np.int32), pa.array([topic])).cast(pa.string()),
                pa.array(np.full(count, partition, np.int32)),
                pa.array(self.offsets, pa.int64()),
                micros.cast(TIMESTAMP),
                pa.array([_SPARK_TIMESTAMP_TYPE.get(t, -1) for t in self.types], pa.int32()),
                pa.nulls(count, HEADERS_TYPE) if self.headers is None else pa.array(self.headers, HEADERS_TYPE),
                millis,
            ],
            schema=RECORD_SCHEMA,
        )
        self.__init__(self.headers is not None)
        return batch

