"""The consumer a Spark task reads its ranges with, one after another, its fetches fitted to each range.

librdkafka reads ahead of the application: fetches of ``max.partition.fetch.bytes`` (1 MiB by
default), and more while fewer than ``queued.min.messages`` are queued; what it fetched past a
range's end is thrown away when the next range is assigned. Invariant: the settings a consumer is
made with are ``consumer_config``'s (the user's ``kafka_options`` over the project's defaults),
plus a fetch size only where the user set none; what a range reads is read_messages' business.
"""

from __future__ import annotations

from typing import Mapping

from confluent_kafka import Consumer

from oncemore.kafka.access import new_client
from oncemore.kafka.clients import CLIENT_LOG

# max.partition.fetch.bytes a task's consumer takes (FittedConsumer): steps of 4, so that a task of
# ranges of mixed sizes seldom makes a new consumer; the largest is librdkafka's default.
FETCH_SIZES = (64 << 10, 256 << 10, 1 << 20)
# A range is fetched in about this many fetches: what the client fetches past a range's end (up to
# one fetch, more while the task decodes) stays small beside the range.
FETCHES_PER_RANGE = 16
# librdkafka's name for max.partition.fetch.bytes, and that alias (either, set by the user, wins).
_FETCH_SIZE_KEYS = ("fetch.message.max.bytes", "max.partition.fetch.bytes")


def fetch_size(records: int, bytes_per_record: float | None) -> int:
    """The fetch size for a range of ``records``: the largest of FETCH_SIZES at most a
    FETCHES_PER_RANGE-th of its key and value bytes (the smallest for a smaller range); the largest
    while the record size is unknown. Values compressed on the wire make a fetch hold more."""
    if bytes_per_record is None:
        return FETCH_SIZES[-1]
    share = records * bytes_per_record / FETCHES_PER_RANGE
    return max([size for size in FETCH_SIZES if size <= share], default=FETCH_SIZES[0])


class FittedConsumer:
    """The consumer a Spark task reads its ranges with, one after another, its fetches fitted to
    each range (``for_range``; ``read`` tells it how large the records read were).

    With 1,000-record ranges at the start of
    20,000-record partitions that was 15 ms a range against 2.7 ms with 64 KiB fetches, while a
    range of hundreds of thousands of records reads fastest with large fetches (measured in one
    process, Apache Kafka 4.4). So each range gets fetch_size(its records, the task's bytes per
    record so far): a new consumer when that differs from the current one's (a consumer costs about
    as much to make as a small range to read). A fetch size the user set is kept for every range.
    """

    def __init__(self, config: Mapping[str, str], pipeline: str):
        self.config, self.pipeline = config, pipeline  # consumer_config settings; pipeline: named in errors
        self.fixed = any(key in config for key in _FETCH_SIZE_KEYS)
        self.consumer: Consumer | None = None
        self.size: int | None = None
        self.records = self.bytes = 0  # read by this task so far

    def for_range(self, records: int) -> Consumer:
        """The consumer to read a range of ``records`` offsets with."""
        size = None if self.fixed else fetch_size(records, self.bytes / self.records if self.records else None)
        if self.consumer is None or size != self.size:
            self.close()
            config = self.config if size is None else {**self.config, "max.partition.fetch.bytes": str(size)}
            self.consumer, self.size = new_client(Consumer, {**config, "logger": CLIENT_LOG}, self.pipeline), size
        return self.consumer

    def read(self, records: int, bytes_read: int) -> None:
        """A range's ``records`` offsets were read, their keys and values ``bytes_read`` bytes."""
        self.records += records
        self.bytes += bytes_read

    def close(self) -> None:
        if self.consumer is not None:
            consumer, self.consumer = self.consumer, None
            consumer.close()

    def __enter__(self) -> "FittedConsumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
