"""Kafka clients for a pipeline, and the log facts the planner needs.

Only the ListOffsets API is used for planning (earliest, read_committed latest, by timestamp):
no consumer group is joined and no offsets are committed to Kafka.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from confluent_kafka import IsolationLevel, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from .config import Pipeline

REQUEST_TIMEOUT_SECONDS = 30.0


class KafkaSourceError(RuntimeError):
    """Kafka could not answer what a run needs (topic missing, broker unreachable, ...)."""


@dataclass(frozen=True)
class PartitionBounds:
    """What a partition's log holds now: offsets in [earliest, latest) are readable.

    ``latest`` is the last stable offset (read_committed end), never an offset inside an open
    transaction, so a planned range never waits on a transaction that may abort.
    """

    earliest: int
    latest: int


def admin_client(pipeline: Pipeline) -> AdminClient:
    return AdminClient(pipeline.source.kafka_config())


def consumer_config(pipeline: Pipeline) -> dict[str, str]:
    """Settings for a consumer that reads assigned ranges: no group membership, no commits."""
    return {
        # Throughput: measured ~2x over librdkafka defaults on 2 cores (PLATFORM.md).
        "queued.min.messages": "500000",
        "fetch.queue.backoff.ms": "10",
        **pipeline.source.kafka_config(),
        # Not overridable: these make the read exact.
        "group.id": f"oncemore-{pipeline.name}",
        "enable.auto.commit": "false",
        "enable.auto.offset.store": "false",
        "isolation.level": "read_committed",
        "auto.offset.reset": "error",
        "enable.partition.eof": "false",
    }


def topic_partitions(admin: AdminClient, pipeline: Pipeline) -> list[int]:
    topic = pipeline.source.topic
    try:
        # All topics, not a named one: a named Metadata request may auto-create the topic
        # (brokers with auto.create.topics.enable; librdkafka's admin handle allows it).
        metadata = admin.list_topics(timeout=REQUEST_TIMEOUT_SECONDS)
    except KafkaException as exc:
        raise KafkaSourceError(
            f"pipeline {pipeline.name}: cannot reach Kafka at {pipeline.source.bootstrap_servers}: {exc}"
        ) from exc
    topic_md = metadata.topics.get(topic)
    if topic_md is None or topic_md.error is not None or not topic_md.partitions:
        cause = "it does not exist" if topic_md is None else (topic_md.error.str() if topic_md.error else "no partitions")
        raise KafkaSourceError(f"pipeline {pipeline.name}: topic {topic!r} is not available: {cause}")
    return sorted(topic_md.partitions)


def _list_offsets(admin: AdminClient, pipeline: Pipeline, specs: dict[int, OffsetSpec]) -> dict[int, int]:
    if not specs:
        return {}
    topic = pipeline.source.topic
    request = {TopicPartition(topic, p): spec for p, spec in specs.items()}
    futures = admin.list_offsets(
        request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=REQUEST_TIMEOUT_SECONDS
    )
    result = {}
    for tp, future in futures.items():
        try:
            result[tp.partition] = future.result().offset
        except KafkaException as exc:
            raise KafkaSourceError(
                f"pipeline {pipeline.name}: ListOffsets failed for {topic}/{tp.partition}: {exc}"
            ) from exc
    return result


def log_bounds(admin: AdminClient, pipeline: Pipeline, partitions: Iterable[int]) -> dict[int, PartitionBounds]:
    partitions = list(partitions)
    earliest = _list_offsets(admin, pipeline, {p: OffsetSpec.earliest() for p in partitions})
    latest = _list_offsets(admin, pipeline, {p: OffsetSpec.latest() for p in partitions})
    return {p: PartitionBounds(earliest=earliest[p], latest=latest[p]) for p in partitions}


def offsets_for_timestamp(
    admin: AdminClient, pipeline: Pipeline, timestamp_ms: int, partitions: Iterable[int]
) -> dict[int, int | None]:
    """Per partition, the first offset whose record timestamp is >= ``timestamp_ms``;
    None where no record is that recent yet."""
    found = _list_offsets(admin, pipeline, {p: OffsetSpec.for_timestamp(timestamp_ms) for p in partitions})
    return {p: (offset if offset >= 0 else None) for p, offset in found.items()}
