"""Kafka clients for a pipeline, the log facts the planner needs, and the one loop that reads a range.

Planning uses metadata (partitions, topic ID, cluster ID) and ListOffsets (earliest,
read_committed latest, by timestamp); no consumer group is joined and no offsets are committed.
``read_messages`` is how every reader (Spark tasks, the planner's timestamp checks) walks
offsets [start, end) of one partition: read_committed, past transaction markers, never hanging.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

from confluent_kafka import Consumer, IsolationLevel, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from .config import Pipeline

REQUEST_TIMEOUT_SECONDS = 30.0
_POLL_SECONDS = 0.5
# A topic ID of all zeros is how the protocol says "no ID" (brokers before Kafka 2.8).
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


class KafkaSourceError(RuntimeError):
    """Kafka could not answer what a run needs (topic missing, broker unreachable, ...)."""


class KafkaReadError(RuntimeError):
    """Reading a planned range failed: records missing, out of range, or no progress."""


@dataclass(frozen=True)
class PartitionBounds:
    """What a partition's log holds now: offsets in [earliest, latest) are readable.

    ``latest`` is the last stable offset (read_committed end), never an offset inside an open
    transaction, so a planned range never waits on a transaction that may abort.
    """

    earliest: int
    latest: int


@dataclass(frozen=True)
class TopicIdentity:
    """Which topic, on which cluster, offsets refer to. A topic deleted and recreated under the
    same name gets a new ``topic_id``; None where the broker reports none."""

    topic_id: str | None
    cluster_id: str | None


@dataclass(frozen=True)
class TopicState:
    partitions: list[int]
    identity: TopicIdentity


def admin_client(pipeline: Pipeline) -> AdminClient:
    return AdminClient(pipeline.source.kafka_config())


def consumer_config(pipeline: Pipeline) -> dict[str, str]:
    """Settings for a consumer that reads assigned ranges: no group membership, no commits."""
    return {
        # Throughput: measured ~2x over librdkafka defaults on 2 cores (PLATFORM.md). The
        # prefetch queue stays bounded by queued.max.messages.kbytes (64 MiB) whatever the values' size.
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


def describe_topic(admin: AdminClient, pipeline: Pipeline) -> TopicState:
    """The topic's partitions and identity. Fails if the topic does not exist."""
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
    # DescribeTopics never auto-creates; it is asked only once the topic is known to exist.
    (future,) = admin.describe_topics(TopicCollection([topic]), request_timeout=REQUEST_TIMEOUT_SECONDS).values()
    try:
        topic_id = str(future.result().topic_id)
    except KafkaException as exc:
        raise KafkaSourceError(f"pipeline {pipeline.name}: cannot describe topic {topic!r}: {exc}") from exc
    identity = TopicIdentity(
        topic_id=None if topic_id in ("", _NO_TOPIC_ID) else topic_id,
        cluster_id=metadata.cluster_id or None,
    )
    return TopicState(sorted(topic_md.partitions), identity)


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
    """Kafka's answer per partition: the first offset at or after ``timestamp_ms`` below the last
    stable offset, *transaction markers included* (they carry the broker's clock); None where
    there is none. ``bounds.resolve`` turns this into the first data record by reading."""
    found = _list_offsets(admin, pipeline, {p: OffsetSpec.for_timestamp(timestamp_ms) for p in partitions})
    return {p: (offset if offset >= 0 else None) for p, offset in found.items()}


def read_messages(
    config: Mapping[str, str], topic: str, partition: int, start: int, end: int, stall_timeout: float, where: str
) -> Iterator[list]:
    """The data messages of ``topic/partition`` in [start, end), in offset order, a list at a time.

    Stops once the consumer's position reaches ``end``: offsets held by transaction markers,
    aborted or compacted records are never delivered, so counting messages would wait forever.
    Fails (KafkaReadError naming the offsets) on a read error, an offset out of range, or when
    the position does not move for ``stall_timeout`` seconds. Closing the generator early is fine.
    """
    consumer = Consumer(dict(config))
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        position, last_progress = start, time.monotonic()
        while position < end:
            messages = consumer.consume(num_messages=10_000, timeout=_POLL_SECONDS)
            if messages:
                errors = [m.error() for m in messages if m.error() is not None]
                if errors:
                    raise KafkaReadError(f"{where}: read failed at offset {position} of range [{start}, {end}): {errors[0]}")
                if messages[0].offset() < position:
                    raise KafkaReadError(f"{where}: broker returned offset {messages[0].offset()} before position {position}")
                if messages[-1].offset() >= end:
                    messages = [m for m in messages if m.offset() < end]
                    new_position = end
                else:
                    new_position = messages[-1].offset() + 1
                if messages:
                    yield messages
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
    finally:
        consumer.close()
