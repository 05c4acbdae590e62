"""The core exactly-once path on Apache Kafka 3.9 (devtools.kafkabroker.start_kafka(version="3.9")),
the last 3.x release, which many users still run beside 4.x: its transactions (version 1: the
coordinator writes the markers after EndTxn), its last stable offset under a transaction left
open, its control records, and records stamped hours ahead (3.9 takes them; 4.x refuses them
unless the topic allows it). The rest of the suite runs on 4.4.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import pytest
from confluent_kafka import IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import OffsetSpec

from conftest import held_positions, oncemore, orders, produced_coordinates, read_coordinates
from devtools.kafkabroker import kafka_full_version, running, start_kafka

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def broker():
    """Kafka 3.9 for this module, in place of the session's 4.4 broker: the fixtures built on
    ``broker`` (``topic``, ``make_pipeline``) use it."""
    with running(start_kafka(version="3.9")) as local:
        yield local
        gc.collect()  # client handles first, or their reconnect errors print after pytest's summary


def last_stable_offsets(broker, topic: str) -> dict[int, int]:
    futures = broker.admin().list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in (0, 1, 2)},
                                          isolation_level=IsolationLevel.READ_COMMITTED)
    return {key.partition: future.result(timeout=30).offset for key, future in futures.items()}


def test_a_run_on_kafka_3_9_takes_every_committed_record_once_up_to_the_last_stable_offset(broker, topic,
                                                                                            make_pipeline):
    assert f"Kafka version: {kafka_full_version('3.9')}" in broker.log_path.read_text()
    ahead = int(time.time() * 1000) + 2 * 3600_000
    produced = broker.produce(topic, [(p, k, v, ahead) for p, k, v, _ in orders(0, 30)])
    produced += broker.produce(topic, orders(30, 300), transactional_id="writer")
    broker.produce(topic, orders(330, 300), transactional_id="writer", abort=True)
    produced += broker.produce(topic, orders(630, 300), transactional_id="writer")
    # A transaction left open on partition 0 holds its last stable offset below its log end.
    open_writer = Producer({"bootstrap.servers": broker.bootstrap_servers, "transactional.id": "open",
                            "logger": logging.getLogger("test_kafka39")})  # not stderr, after the broker stops
    open_writer.init_transactions(30)
    open_writer.begin_transaction()
    try:
        for i in range(10):
            open_writer.produce(topic, orders(1000 + i, 1)[0][2], partition=0)
        open_writer.flush(30)
        stable = last_stable_offsets(broker, topic)
        assert stable[0] == max(o for p, o in produced if p == 0) + 2, "the last commit's marker, then the open one"
        pipeline = make_pipeline(topic)
        env = {"ONCEMORE_PIPELINES_DIR": str(Path(pipeline.origin).parent)}

        first = oncemore("run", "orders", env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        assert f"committed 1 batch(es), {len(produced)} records written, 0 quarantined" in first.stdout
        again = oncemore("run", "orders", env=env, check_no_spark=True)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "no-op (nothing new to ingest)" in again.stdout

        # Every (topic, partition, offset) of the committed ranges [0, last stable offset) holding a
        # committed record is in the table once; the aborted ones, the markers and the open
        # transaction's are not.
        coordinates = read_coordinates(pipeline.sink.table_uri)
        assert len(coordinates) == len(set(coordinates)), "a record twice"
        assert coordinates == sorted(produced_coordinates(topic, produced))
        assert held_positions(pipeline.sink.table_uri, "orders", topic) == stable
    finally:
        open_writer.abort_transaction(30)
