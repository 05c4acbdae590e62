"""Mirrors a pipeline's committed positions to the Kafka consumer group ``oncemore.<pipeline>``
(``commit_consumer_group: true``), so the tools that watch consumer groups (kafka-consumer-groups,
Burrow, lag exporters) show the pipeline's lag.

Invariant: the mirror is written after the Delta commit and never read back; the Delta log stays
the only source of truth, so a mirror that fails or lags costs a wrong lag figure, never a record.
A failure never gates a commit: it is logged and kept (``failure``), and the run fails once its
commits are done (DESIGN.md 8; every commit re-states all positions, so the next run's mirror
catches up); a group Kafka's authorizer denies is said once per run, which then stops asking (each
commit would be denied the same way).

The offsets go through the admin client's AlterConsumerGroupOffsets (Kafka's OffsetCommit as an
admin request, for a group nobody joins): READ on the group (and on the topics, which a run has)
is what Kafka asks, and a denial comes back at once, where a consumer's commit waited for a
coordinator it was never given until its timeout.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Mapping

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from oncemore.config.model import Pipeline
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import KafkaAccessDenied
from oncemore.kafka.clients import admin_client

log = logging.getLogger("oncemore")
_COORDINATOR_MOVING = {KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.NOT_COORDINATOR,
                       KafkaError.COORDINATOR_NOT_AVAILABLE}


def group_id(pipeline: Pipeline) -> str:
    return f"oncemore.{pipeline.name}"


class GroupMirror:
    """The mirror of one run: one admin client for its commits, whether the group was denied, and
    the run's first failure to mirror (None while every commit was mirrored)."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline
        self.denied = False
        self.failure: str | None = None
        self._admin: AdminClient | None = None

    def mirror(self, positions: Mapping[KafkaPartition, int], table_version: int | str) -> bool:
        """Commits ``positions`` (next offset to read, per partition) as the group's offsets, each
        with metadata naming the table version that holds it (with routes, each table's, as text).
        True when the broker took them."""
        pipeline = self.pipeline
        if self.denied:
            return False
        offsets = [TopicPartition(p.topic, p.partition, offset, metadata=f"oncemore table version {table_version}")
                   for p, offset in sorted(positions.items())]
        try:
            self._admin = self._admin or admin_client(pipeline)
            refused = _alter(self._admin, pipeline, offsets)
            if refused:
                raise KafkaException(refused[0])
            return True
        except KafkaAccessDenied as exc:
            self.denied = True
            self.failure = self.failure or str(exc)
            log.warning("%s; positions are not mirrored for the rest of this run (the table holds them, only lag "
                        "tools lag)", exc)
        except Exception as exc:  # KafkaException, a broker that cannot be reached: the table holds the positions
            cause = f"{exc.args[0] if exc.args else exc}"
            self.failure = self.failure or (f"pipeline {pipeline.name}: could not mirror table version {table_version} "
                                            f"to consumer group {group_id(pipeline)}: {cause}")
            log.warning("pipeline %s: could not mirror positions of %s (table version %s) to consumer group %s: %s; "
                        "the table holds them, only lag tools lag", pipeline.name,
                        pipeline.source.describe_subscription(), table_version, group_id(pipeline), cause)
        return False


def check_group(admin: AdminClient, pipeline: Pipeline) -> None:
    """Raises KafkaAccessDenied when Kafka would refuse the mirror's commits, writing nothing: an
    offset of a topic that does not exist is committed, which Kafka refuses for the group first
    (GROUP_AUTHORIZATION_FAILED, before it looks at the topics) and otherwise for the topic
    (unknown, or not readable), so no offset is stored and no group is created."""
    refused = _alter(admin, pipeline, [TopicPartition(f"oncemore-check-{uuid.uuid4().hex}", 0, 0)])
    unexpected = [e for e in refused if e.code() not in (KafkaError.UNKNOWN_TOPIC_OR_PART,
                                                         KafkaError.TOPIC_AUTHORIZATION_FAILED)]
    if unexpected:  # the group's coordinator never answered, ...
        raise KafkaException(unexpected[0])


def _alter(admin: AdminClient, pipeline: Pipeline, offsets: list[TopicPartition]) -> list[KafkaError]:
    """Sets the group's offsets to ``offsets``; the errors of those Kafka refused, or
    KafkaAccessDenied when it refused the group. A coordinator still loading or moving (the first
    commit of a cluster's first group) is asked again within the stall timeout: the admin client
    does not retry it."""
    timeout = pipeline.source.stall_timeout_seconds
    deadline = time.monotonic() + timeout
    request = ConsumerGroupTopicPartitions(group_id(pipeline), offsets)
    while True:
        (future,) = admin.alter_consumer_group_offsets([request], request_timeout=timeout).values()
        try:
            errors = [tp.error for tp in future.result(timeout=timeout + 5).topic_partitions if tp.error is not None]
        except KafkaException as exc:
            errors = [exc.args[0]] if exc.args and isinstance(exc.args[0], KafkaError) else []
            if not errors:
                raise
        for error in errors:
            _raise_if_denied(pipeline, error)
        if not errors or time.monotonic() > deadline or any(e.code() not in _COORDINATOR_MOVING for e in errors):
            return errors
        time.sleep(0.1)


def _raise_if_denied(pipeline: Pipeline, error: object) -> None:
    if isinstance(error, KafkaError) and error.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
        raise KafkaAccessDenied(f"pipeline {pipeline.name}: Kafka denies READ on consumer group {group_id(pipeline)!r} "
                                "(GROUP_AUTHORIZATION_FAILED), which the consumer-group mirror "
                                "(commit_consumer_group: true) needs",
                                pipeline=pipeline.name, resource="group", name=group_id(pipeline), operation="READ")
