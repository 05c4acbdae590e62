"""Mirrors a pipeline's committed positions to the Kafka consumer group ``oncemore.<pipeline>``
(``commit_consumer_group: true``), so the tools that watch consumer groups (kafka-consumer-groups,
Burrow, lag exporters) show the pipeline's lag.

Invariant: the mirror is written after the Delta commit and never read back; the Delta log stays
the only source of truth, so a mirror that fails or lags costs a wrong lag figure, never a record.
A failure is logged, not raised.
"""

from __future__ import annotations

import logging
from typing import Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition

from oncemore.config.model import Pipeline
from oncemore.core.coordinates import KafkaPartition
from oncemore.kafka.clients import CLIENT_LOG, consumer_config

log = logging.getLogger("oncemore")


def group_id(pipeline: Pipeline) -> str:
    return f"oncemore.{pipeline.name}"


def mirror_positions(pipeline: Pipeline, positions: Mapping[KafkaPartition, int], table_version: int) -> bool:
    """Commits ``positions`` (next offset to read, per partition) as the group's offsets, each
    with metadata naming the table version that holds it. True when the broker took them."""
    consumer = Consumer({
        **consumer_config(pipeline), "group.id": group_id(pipeline), "logger": CLIENT_LOG,
        # A synchronous commit waits for the group coordinator up to the session timeout (45 s by
        # default): bound it by the pipeline's stall timeout. The group is never joined, so the
        # broker's minimum session timeout does not apply.
        "session.timeout.ms": str(max(int(pipeline.source.stall_timeout_seconds * 1000), 1000)),
    })
    try:
        offsets = [TopicPartition(p.topic, p.partition, offset, metadata=f"oncemore table version {table_version}")
                   for p, offset in sorted(positions.items())]
        # Synchronous: the group shows the positions once this returns. Never joins the group.
        failed = [tp for tp in consumer.commit(offsets=offsets, asynchronous=False) if tp.error is not None]
        if failed:
            raise KafkaException(failed[0].error)
        return True
    except KafkaException as exc:
        log.warning("pipeline %s: could not mirror positions of %s (table version %d) to consumer group %s: %s; "
                    "the table holds them, only lag tools lag", pipeline.name, pipeline.source.describe_subscription(), table_version,
                    group_id(pipeline), exc.args[0] if exc.args else exc)
        return False
    finally:
        consumer.close()
