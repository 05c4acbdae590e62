"""Where a record lives in Kafka, named the same way everywhere: a KafkaPartition is a (topic,
partition) pair, written ``topic/partition`` in text and in JSON keys; an OffsetRange is offsets
[start, end) of one partition, what a plan hands to a run and a run to its tasks. Kafka topic
names hold only ASCII letters, digits, ``.``, ``_`` and ``-``, so the slash never belongs to a
topic name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, TypeVar

V = TypeVar("V")


class KafkaPartition(NamedTuple):
    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}"

    @classmethod
    def parse(cls, text: str) -> "KafkaPartition":
        topic, _, partition = text.rpartition("/")
        return cls(topic, int(partition))


def by_text(values: Mapping[KafkaPartition, V]) -> dict[str, V]:
    """``{"topic/partition": value}``, in order, for JSON."""
    return {str(key): value for key, value in sorted(values.items())}


def from_text(values: Mapping[str, V]) -> dict[KafkaPartition, V]:
    return {KafkaPartition.parse(key): value for key, value in values.items()}


def nested(values: Mapping[KafkaPartition, V]) -> dict[str, dict[str, V]]:
    """``{topic: {partition: value}}``: the shape of Spark's Kafka offsets options and of the
    commit records' ranges."""
    out: dict[str, dict[str, V]] = {}
    for key, value in sorted(values.items()):
        out.setdefault(key.topic, {})[str(key.partition)] = value
    return out


def flat(values: Mapping[str, Mapping[str, V]]) -> dict[KafkaPartition, V]:
    return {KafkaPartition(topic, int(p)): v for topic, partitions in values.items() for p, v in partitions.items()}


def describe(keys: Iterable[KafkaPartition]) -> str:
    return ", ".join(map(str, sorted(keys)))


@dataclass(frozen=True, order=True)
class OffsetRange:
    """Offsets [start, end) of one partition; ``end`` is the position committed after it."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def key(self) -> KafkaPartition:
        return KafkaPartition(self.topic, self.partition)

    @property
    def count(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition} [{self.start}, {self.end})"
