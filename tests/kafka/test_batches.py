"""The range reader (kafka/batches.py) on scripted consume() lists: where batches and byte budgets cut
a list, every field of a record, and lists holding errors or another partition's records. The
broker decides where consume() lists end; here the test does (test_kafkasource.py reads a real
broker)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from confluent_kafka import KafkaError, Message, TopicPartition

from oncemore.kafka import batches as records_module
from oncemore.kafka.batches import READ_SCHEMA, RangeRecords

TOPIC = "orders"


class ScriptedConsumer:
    """Returns the given consume() lists in turn; its position follows the last data record."""

    def __init__(self, lists: list[list[Message]], end: int):
        self.lists, self.end, self.position_ = list(lists), end, 0

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.position_ = partitions[0].offset

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        if not self.lists:
            self.position_ = self.end  # what is left holds only transaction markers
            return []
        found = self.lists.pop(0)
        data = [m for m in found if m.error() is None and (m.topic(), m.partition()) == (TOPIC, 0)]
        if data:
            self.position_ = data[-1].offset() + 1
        return found

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(TOPIC, 0, self.position_)]


def message(offset: int, value: bytes | None = b"v" * 10, key: bytes | None = None, timestamp=(1, 1_700_000_000_000),
            headers=None, topic: str = TOPIC, partition: int = 0) -> Message:
    return Message(topic=topic, partition=partition, offset=offset, key=key, value=value, timestamp=timestamp,
                   headers=headers)


def read(lists, start: int, end: int, max_bytes: int | None = None, headers: bool = False):
    reader = RangeRecords(ScriptedConsumer(lists, end), TOPIC, 0, start, end, 5.0, "test", max_bytes, headers)
    return reader, list(reader)


@pytest.fixture
def small_batches(monkeypatch):
    monkeypatch.setattr(records_module, "BATCH_ROWS", 4)
    monkeypatch.setattr(records_module, "BATCH_BYTES", 1 << 20)


def test_batches_cut_across_consume_lists_and_a_budget_reached_at_a_list_end(small_batches):
    lists = [[message(o) for o in range(0, 3)], [message(o) for o in range(3, 7)], [message(o) for o in range(7, 12)]]
    reader, batches = read(lists, 0, 12)
    assert [b.num_rows for b in batches] == [4, 4, 4]
    assert pa.Table.from_batches(batches).column("offset").to_pylist() == list(range(12))
    assert (reader.reached, reader.bytes_read) == (12, 120)

    # The budget is reached by the last record of the second list: the read stops there.
    reader, batches = read([[message(o) for o in range(0, 3)], [message(o) for o in range(3, 7)],
                            [message(o) for o in range(7, 12)]], 0, 12, max_bytes=70)
    assert pa.Table.from_batches(batches).column("offset").to_pylist() == list(range(7))
    assert (reader.reached, reader.bytes_read) == (7, 70)


def test_every_field_is_carried_as_kafka_gave_it():
    beyond = (2**63 - 1) // 1000 + 1  # milliseconds no microsecond int64 holds
    sent = [
        message(10, value=None, key=b"k", timestamp=(1, 1_700_000_000_123)),  # a tombstone
        message(11, value=b"", key=None, timestamp=(2, -5)),  # LogAppendTime, before 1970
        message(13, value=b"x", timestamp=(0, -1), headers=[]),  # no timestamp; 12 is a marker
        message(14, value=b"y", timestamp=(1, beyond), headers=[("a", b"1"), ("a", None), ("b", b"")]),
    ]
    reader, batches = read([sent], 10, 15, headers=True)
    table = pa.Table.from_batches(batches, schema=READ_SCHEMA)
    assert table.column("offset").to_pylist() == [10, 11, 13, 14]
    assert table.column("key").to_pylist() == [b"k", None, None, None]
    assert table.column("value").to_pylist() == [None, b"", b"x", b"y"]
    assert table.column("timestamp").cast(pa.int64()).to_pylist() == [1_700_000_000_123_000, -5_000, None, None]
    assert table.column("timestamp_ms").to_pylist() == [1_700_000_000_123, -5, None, beyond]
    assert table.column("timestampType").to_pylist() == [0, 1, -1, 0]
    assert table.column("headers").to_pylist() == [[], [], [], [{"key": "a", "value": b"1"}, {"key": "a", "value": None},
                                                                 {"key": "b", "value": b""}]]
    assert (reader.reached, reader.bytes_read) == (15, 1 + 1 + 1)


def test_errors_and_other_partitions_records_in_a_list_are_left_out():
    lists = [[message(0), Message(error=KafkaError(KafkaError._TRANSPORT)), message(1, partition=1),
              message(1), message(2, topic="payments"), message(2)]]
    reader, batches = read(lists, 0, 3)
    assert pa.Table.from_batches(batches).column("offset").to_pylist() == [0, 1, 2]
    assert set(pa.Table.from_batches(batches).column("partition").to_pylist()) == {0}
    assert (reader.reached, reader.bytes_read) == (3, 30)


def test_a_reader_stopped_at_an_offset_counts_only_the_bytes_before_it(small_batches):
    reader = RangeRecords(ScriptedConsumer([[message(o) for o in range(10)]], 10), TOPIC, 0, 0, 10, 5.0, "test")
    for batch in reader:
        if 5 in batch.column("offset").to_pylist():
            reader.stop_at(5)  # as a schema-ahead record stops a range (tasks._RangeDecoding)
            break
    assert (reader.reached, reader.bytes_read) == (5, 50)
