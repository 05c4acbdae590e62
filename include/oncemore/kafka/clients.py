"""Kafka clients for a pipeline, the log facts the planner needs, and the one loop that reads a range.

Planning uses metadata (partitions, topic ID, cluster ID) and ListOffsets (earliest,
read_committed latest, by timestamp); no consumer group is joined and no offsets are committed.
``read_messages`` is how every reader (Spark tasks, the planner's timestamp checks) walks
offsets [start, end) of one partition: read_committed, past transaction markers, never hanging.

What Kafka's authorizer must allow is in access.py; ``check_readable`` fetches once per topic,
so that a planned run finds a missing READ before it creates a table or starts Spark.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Message,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec

from oncemore.core.coordinates import KafkaPartition
from oncemore.core.suggest import closest
from oncemore.kafka.access import new_client, topic_denied

if TYPE_CHECKING:  # a Spark task reading Kafka never needs the config models (pydantic's import)
    from oncemore.config.model import Pipeline

_POLL_SECONDS = 0.5
# A partition's leader is moving (a restart, an election, a partition just created): ask again. The
# admin client's errors carry no retriable flag for these.
_LEADER_MOVING = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_LEADER_EPOCH,
                  KafkaError.FENCED_LEADER_EPOCH, KafkaError.REPLICA_NOT_AVAILABLE, KafkaError.OFFSET_NOT_AVAILABLE}
# How long a stalled read asks for metadata to tell an unreachable broker from records that are gone.
_PROBE_SECONDS = 3.0
# librdkafka's own log (connection retries, ...): through Python logging, not straight to stderr.
# Failures reach the caller as errors naming what failed; the CLI keeps this log quiet.
CLIENT_LOG = logging.getLogger("oncemore.librdkafka")
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
class SourceState:
    """The pipeline's topics as the cluster has them now: every partition, and each topic's identity."""

    partitions: list[KafkaPartition]
    identities: dict[str, TopicIdentity]

    @property
    def topics(self) -> list[str]:
        return sorted(self.identities)


def _timeout(pipeline: Pipeline) -> float:
    """How long a Kafka request may take: the pipeline's stall timeout bounds every wait on Kafka."""
    return pipeline.source.stall_timeout_seconds


def admin_client(pipeline: Pipeline) -> AdminClient:
    """An admin client that keeps librdkafka's error events (``client_errors``): a request that
    times out says only "transport failure", the events say why (refused, authentication, TLS)."""
    errors: list[KafkaError] = []
    client = new_client(AdminClient, {**pipeline.source.kafka_config(), "logger": CLIENT_LOG,
                                      "error_cb": errors.append}, pipeline.name)
    client.client_errors = errors
    return client


def _why(admin: AdminClient, exc: KafkaException) -> str:
    """The failure of a request, with the client's last error event that names a cause (a refused
    connection, a name that does not resolve, a failed authentication: not "all brokers down")."""
    admin.poll(0)  # serves queued error events
    events = [e for e in getattr(admin, "client_errors", []) if e.code() != KafkaError._ALL_BROKERS_DOWN]
    cause = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
    return f"{cause} (last client error: {events[-1].str()})" if events else cause


def _all_brokers_down(admin: AdminClient) -> bool:
    admin.poll(0)
    return any(e.code() == KafkaError._ALL_BROKERS_DOWN for e in getattr(admin, "client_errors", []))


def cluster_metadata(admin: AdminClient, pipeline: Pipeline):
    """The cluster's metadata, asked until the stall timeout; but a run starting against bootstrap
    servers that are all down (a refused connection, a host name that does not resolve, a failed
    authentication: librdkafka says so within milliseconds) fails at once instead of waiting."""
    source = pipeline.source
    deadline = time.monotonic() + _timeout(pipeline)
    while True:
        try:
            return admin.list_topics(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except KafkaException as exc:
            if _all_brokers_down(admin):
                raise KafkaSourceError(f"pipeline {pipeline.name}: cannot reach Kafka at {source.bootstrap_servers}: "
                                       f"{_why(admin, exc)}") from exc
            if time.monotonic() >= deadline:
                raise KafkaSourceError(
                    f"pipeline {pipeline.name}: cannot reach Kafka at {source.bootstrap_servers} within "
                    f"{_timeout(pipeline):.0f}s (source.stall_timeout_seconds): {_why(admin, exc)}") from exc


def consumer_config(pipeline: Pipeline) -> dict[str, str]:
    """Settings for a consumer that reads assigned ranges: no group membership, no commits."""
    return {
        # The prefetch queue, what a task's memory grows with: librdkafka fetches ahead until this
        # many messages (or queued.max.messages.kbytes, 64 MiB of keys and values) are queued, and
        # each queued message costs a few hundred bytes on top of its own. At 500,000 a range's
        # reader grew with the range (one process reading 1.25 M records of ~200 B peaked 227 MiB
        # above its imports, and a Python worker of a 5 M-record run at 600 MiB); at 50,000 it stayed
        # ~55 MiB above them whatever the range, read as fast; at 10,000 a replayed task of 500,000
        # records peaked 32 MiB lower again, at the same speed, and a 1 M-record run's tree ~50 (measured
        # on a local broker: over a slow network, kafka_options may raise it; docs/performance.md,
        # "Memory beside the peer").
        "queued.min.messages": "10000",
        # Throughput: a full queue pauses fetching for this long (librdkafka's default, 1 s, halved
        # the rate on 2 cores: PLATFORM.md).
        "fetch.queue.backoff.ms": "10",
        # A range's reader waits for its last records; a fetch the broker parks for the default
        # 500 ms made every small range cost half a second (measured on the test broker; 100 ms: 66 ms).
        # At 10 ms a range ending at the log's end still cost 12 ms: the client fetches on past its
        # last record, the broker parks that fetch, and the next range's first fetch waits behind it
        # (one fetch in flight per broker). 1 ms: 2.5 ms a range of 1,000 records (Apache Kafka
        # 4.4, one process); 0 made a large range slower (the client fetched in a busy loop).
        "fetch.wait.max.ms": "1",
        **pipeline.source.kafka_config(),
        # Not overridable: these make the read exact. confluent-kafka's consumer cannot be made
        # without a group id; it is never joined nor committed to (read_messages ignores a denial
        # of it: librdkafka asks for its coordinator whatever the consumer does).
        "group.id": f"oncemore-{pipeline.name}",
        "enable.auto.commit": "false",
        "enable.auto.offset.store": "false",
        "isolation.level": "read_committed",
        "auto.offset.reset": "error",
        "enable.partition.eof": "false",
    }


def describe_source(admin: AdminClient, pipeline: Pipeline, metadata=None) -> SourceState:
    """The partitions and identities of the pipeline's topics: the named ones (each must exist), or
    those matching its pattern now (none is an error: a pattern that matches nothing is a typo
    more often than an empty cluster). ``metadata``: the cluster's (``cluster_metadata``) when the
    caller has just asked for it (kafka/cluster.py, for many pipelines at once)."""
    source = pipeline.source
    # All topics, not named ones: a named Metadata request may auto-create a topic (brokers
    # with auto.create.topics.enable; librdkafka's admin handle allows it).
    metadata = metadata or cluster_metadata(admin, pipeline)
    topics = source.topic_names or sorted(t for t in metadata.topics if source.subscribes(t))
    if not topics:
        raise KafkaSourceError(f"pipeline {pipeline.name}: no topic matches {source.topic_pattern!r} "
                               f"(the cluster has {len(metadata.topics)} topics)")
    for topic in topics:
        topic_md = metadata.topics.get(topic)
        if topic_md is None:
            raise _unlisted(admin, pipeline, topic, metadata.topics)
        if topic_md.error is not None or not topic_md.partitions:
            cause = topic_md.error.str() if topic_md.error else "no partitions"
            raise KafkaSourceError(f"pipeline {pipeline.name}: topic {topic!r} is not available: {cause}")
    # DescribeTopics never auto-creates; it is asked only once the topics are known to exist.
    futures = admin.describe_topics(TopicCollection(list(topics)), request_timeout=_timeout(pipeline))
    identities = {}
    for topic, future in futures.items():
        try:
            topic_id = str(future.result().topic_id)
        except KafkaException as exc:
            raise KafkaSourceError(f"pipeline {pipeline.name}: cannot describe topic {topic!r}: {_why(admin, exc)}") from exc
        identities[topic] = TopicIdentity(topic_id=None if topic_id in ("", _NO_TOPIC_ID) else topic_id,
                                          cluster_id=metadata.cluster_id or None)
    partitions = sorted(KafkaPartition(t, p) for t in topics for p in metadata.topics[t].partitions)
    return SourceState(partitions, identities)


def _unlisted(admin: AdminClient, pipeline: Pipeline, topic: str, listed: Iterable[str]) -> Exception:
    """Why a named topic is not in the cluster's metadata, with the listed topic it may be a typo
    of. Kafka lists only the topics the principal may describe, and DescribeTopics tells a denied
    name (TOPIC_AUTHORIZATION_FAILED: whether it exists, Kafka tells only those who may describe
    it) from a missing one."""
    meant = closest(topic, [t for t in listed if not t.startswith("__")])
    typo = f"; did you mean {meant!r}?" if meant else ""
    (future,) = admin.describe_topics(TopicCollection([topic]), request_timeout=_timeout(pipeline)).values()
    try:
        future.result()
    except KafkaException as exc:
        if exc.args and isinstance(exc.args[0], KafkaError) and exc.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            return topic_denied(f"pipeline {pipeline.name}", topic, "DESCRIBE",
                                "; whether it exists Kafka tells only those who may describe it", after=typo)
    else:  # created since the metadata was read
        return KafkaSourceError(f"pipeline {pipeline.name}: topic {topic!r} is not available yet: it was just created")
    return KafkaSourceError(f"pipeline {pipeline.name}: topic {topic!r} is not available: it does not exist{typo}")


def check_readable(pipeline: Pipeline, bounds: Mapping[KafkaPartition, PartitionBounds]) -> None:
    """Raises KafkaAccessDenied naming the first topic of ``bounds`` whose records the principal
    may not read. Everything else planning asks needs only DESCRIBE, so this is the one way to
    learn it before Spark: one fetch per topic, of its first partition at the end of its log (an
    empty answer costs the broker nothing), all by one consumer; the read is allowed once a fetch
    answers with a record or the end of the partition."""
    first: dict[str, KafkaPartition] = {}
    for partition in sorted(bounds):
        first.setdefault(partition.topic, partition)
    if not first:
        return
    where = f"pipeline {pipeline.name}"
    deadline = time.monotonic() + _timeout(pipeline)
    with range_consumer({**consumer_config(pipeline), "enable.partition.eof": "true"}, pipeline.name) as consumer:
        consumer.assign([TopicPartition(p.topic, p.partition, bounds[p].latest) for p in first.values()])
        pending = set(first)
        while pending:
            for message in consumer.consume(num_messages=len(pending), timeout=_POLL_SECONDS):
                error, topic = message.error(), message.topic()
                if error is None or error.code() == KafkaError._PARTITION_EOF:
                    pending.discard(topic)
                elif error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                    raise topic_denied(where, topic, "READ")
                elif topic is not None and not _transient(error):
                    raise KafkaSourceError(f"{where}: a fetch of topic {topic!r} failed: {error.name()}: {error.str()}")
            if pending and time.monotonic() > deadline:
                raise KafkaSourceError(f"{where}: Kafka did not answer a fetch of topic(s) {', '.join(sorted(pending))} "
                                       f"within {_timeout(pipeline):.0f}s (source.stall_timeout_seconds)")


def _list_offsets(admin: AdminClient, pipeline: Pipeline, specs: dict[KafkaPartition, OffsetSpec]) -> dict[KafkaPartition, int]:
    """The offsets ``specs`` ask for. A partition whose leader is moving (a broker restarting, a
    partition just created: NOT_LEADER_OR_FOLLOWER, UNKNOWN_LEADER_EPOCH, which librdkafka's admin
    client does not retry) is asked again, with fresh metadata, until the stall timeout."""
    result: dict[KafkaPartition, int] = {}
    deadline = time.monotonic() + _timeout(pipeline)
    while specs:
        request = {TopicPartition(key.topic, key.partition): spec for key, spec in specs.items()}
        futures = admin.list_offsets(
            request, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=_timeout(pipeline)
        )
        retry = {}
        for tp, future in futures.items():
            key = KafkaPartition(tp.topic, tp.partition)
            try:
                result[key] = future.result().offset
            except KafkaException as exc:
                if exc.args[0].code() not in _LEADER_MOVING or time.monotonic() > deadline:
                    raise KafkaSourceError(
                        f"pipeline {pipeline.name}: ListOffsets failed for {tp.topic}/{tp.partition}: {_why(admin, exc)}"
                    ) from exc
                retry[key] = specs[key]
        specs = retry
        if specs:
            time.sleep(_POLL_SECONDS / 10)
            admin.list_topics(timeout=max(0.1, deadline - time.monotonic()))  # the client asks the leaders it knows
    return result


def log_bounds(admin: AdminClient, pipeline: Pipeline, partitions: Iterable[KafkaPartition]) -> dict[KafkaPartition, PartitionBounds]:
    partitions = list(partitions)
    earliest = _list_offsets(admin, pipeline, {p: OffsetSpec.earliest() for p in partitions})
    latest = _list_offsets(admin, pipeline, {p: OffsetSpec.latest() for p in partitions})
    return {p: PartitionBounds(earliest=earliest[p], latest=latest[p]) for p in partitions}


def offsets_for_timestamp(
    admin: AdminClient, pipeline: Pipeline, timestamp_ms: int, partitions: Iterable[KafkaPartition]
) -> dict[KafkaPartition, int | None]:
    """Kafka's answer per partition: the first offset at or after ``timestamp_ms`` below the last
    stable offset, *transaction markers included* (they carry the broker's clock); None where
    there is none. ``bounds.resolve`` turns this into the first data record by reading."""
    found = _list_offsets(admin, pipeline, {p: OffsetSpec.for_timestamp(timestamp_ms) for p in partitions})
    return {p: (offset if offset >= 0 else None) for p, offset in found.items()}


@contextmanager
def range_consumer(config: Mapping[str, str], pipeline: str) -> Iterator[Consumer]:
    """A consumer (of ``consumer_config`` settings) for any number of ``read_messages`` calls in turn:
    creating and closing one costs about as much as reading a small range (a Spark task's is a
    fitted.FittedConsumer). A file its settings name that cannot be opened here fails it naming
    ``pipeline``, option and path."""
    consumer = new_client(Consumer, {**config, "logger": CLIENT_LOG}, pipeline)
    try:
        yield consumer
    finally:
        consumer.close()


def read_messages(
    consumer: Consumer, topic: str, partition: int, start: int, end: int, stall_timeout: float, where: str
) -> Iterator[list]:
    """The data messages of ``topic/partition`` in [start, end), in offset order, a list at a time.

    Stops once the consumer's position reaches ``end``: offsets held by transaction markers,
    aborted or compacted records are never delivered, so counting messages would wait forever.
    Fails (KafkaReadError naming the offsets) on a read error, an offset out of range, or when
    the position does not move for ``stall_timeout`` seconds (a pipeline's
    source.stall_timeout_seconds): a broker restart or a lost connection (librdkafka reconnects on
    its own) is waited out for that long, then named with what to do (telling the causes apart
    adds up to _PROBE_SECONDS); and with KafkaAccessDenied when Kafka refuses READ on the topic.
    Closing the generator early is fine; the consumer is assigned to this range alone.
    """
    consumer.assign([TopicPartition(topic, partition, start)])
    position, last_progress, transient = start, time.monotonic(), None
    while position < end:
        # consume() waits for num_messages or the timeout: never ask for more than the range holds.
        messages = consumer.consume(num_messages=min(10_000, end - position), timeout=_POLL_SECONDS)
        # Column by column (map over the C methods): a Python loop per message cost more than the
        # client's own work. The per-message filters below run only when something is off.
        errors = list(filter(None, map(Message.error, messages)))
        if errors:
            messages = [m for m in messages if m.error() is None]
            # The consumer's group is never used: a denial of it says nothing of the read.
            errors = [e for e in errors if e.code() != KafkaError.GROUP_AUTHORIZATION_FAILED]
        fatal = [e for e in errors if not _transient(e)]
        if any(e.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED for e in fatal):
            raise topic_denied(where, topic, "READ")
        if fatal:
            raise KafkaReadError(f"{where}: read failed at offset {position} of range [{start}, {end}): "
                                 f"{fatal[0].name()}: {fatal[0].str()}")
        if errors:  # waited out below, within the stall timeout
            transient = errors[-1]
        # Data of this range only: never a record fetched for an earlier assignment of a reused
        # consumer (librdkafka discards those; this keeps it so).
        if messages and ({*map(Message.partition, messages)} != {partition} or {*map(Message.topic, messages)} != {topic}):
            messages = [m for m in messages if m.partition() == partition and m.topic() == topic]
        if messages:
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
            cause = _stall_cause(consumer, topic, transient)
            raise KafkaReadError(f"{where}: no progress for {stall_timeout:.0f}s (source.stall_timeout_seconds) at "
                                 f"offset {position} of range [{start}, {end}): {cause}")


def _stall_cause(consumer: Consumer, topic: str, transient: KafkaError | None) -> str:
    """Why a read made no progress, and what to do: the broker unreachable (a fetch's error said
    so, or a metadata request fails now: librdkafka reports a refused connection to its logs, not
    to consume()), else the records are gone. Either way nothing of the range was committed, so
    running again is safe."""
    if transient is None:
        try:
            consumer.list_topics(topic, timeout=_PROBE_SECONDS)
        except KafkaException as exc:
            transient = exc.args[0]
    if transient is not None:
        return (f"the broker is unreachable ({transient.name()}: {transient.str()}); start it (or restore the "
                "connection to it), then run again: what was committed stays, and the rerun carries on from there")
    return ("the records are missing from the broker (deleted, or the topic was recreated); run again: its plan "
            "reads the log anew and names what is gone")


def _transient(error: KafkaError) -> bool:
    """Errors librdkafka recovers from by itself (a broker restarting, a dropped connection)."""
    return error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT) or (
        error.retriable() and not error.fatal())
