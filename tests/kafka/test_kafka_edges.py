"""Cases only a real Apache Kafka broker gives: a compacted topic whose cleaner has run (offsets
missing inside ranges, tombstones), topics stored with each compression codec, a record near the
broker's size limit, a broker SIGKILLed mid-run, and an idempotent producer retrying through a
broker crash. Each counted by (topic, partition, offset) against what Kafka itself holds."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

from conftest import assert_exactly_once, order, orders, query, read_pairs
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


def held_offsets(broker, topic: str, partitions: int) -> list[tuple[int, int]]:
    """Every (partition, offset) the broker holds a committed record at, read as oncemore reads."""
    consumer = Consumer({**broker._client_config(), "group.id": f"probe-{uuid.uuid4().hex[:6]}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    try:
        held = []
        for partition in range(partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
            consumer.assign([TopicPartition(topic, partition, low)])
            position = low
            while position < high:
                for message in consumer.consume(1000, timeout=2):
                    if message.error() is None:
                        held.append((partition, message.offset()))
                position = consumer.position([TopicPartition(topic, partition)])[0].offset
        return sorted(held)
    finally:
        consumer.close()


def test_a_compacted_topic_is_ingested_exactly_once_across_the_cleaners_gaps_and_tombstones(
        broker, make_pipeline, spark):
    topic = f"compacted_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 2, {"cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01",
                                   "min.compaction.lag.ms": "0", "delete.retention.ms": "0"})
    # 20 keys written 10 times each; every key's last write in round 9 but for 4 keys deleted by a tombstone.
    updates = [(k % 2, f"k{k}".encode(), order(k + 20 * r), None) for r in range(10) for k in range(20)]
    tombstones = [(k % 2, f"k{k}".encode(), None, None) for k in range(4)]
    broker.produce(topic, updates[:100])
    pipeline = make_pipeline(topic, key={"type": "string"})
    runner.run(pipeline, spark_factory=lambda: spark)  # the first rounds, before any cleaning
    broker.produce(topic, updates[100:] + tombstones)
    deadline = time.monotonic() + 60
    while len(held_offsets(broker, topic, 2)) > 100 and time.monotonic() < deadline:
        time.sleep(0.5)
        broker.produce(topic, [(0, b"roll", order(0), None)])  # closes the active segment for the cleaner
    # The cleaner stops (records must now be an hour old) and the log stays as the next run reads it.
    for done in broker.admin().incremental_alter_configs([ConfigResource("topic", topic, incremental_configs=[
            ConfigEntry("min.compaction.lag.ms", "3600000", incremental_operation=AlterConfigOpType.SET)])]).values():
        done.result(timeout=30)
    held, before = held_offsets(broker, topic, 2), None
    while held != before:
        time.sleep(2)
        held, before = held_offsets(broker, topic, 2), held
    second = {(p, o) for p, o in held if o >= 50}  # what the next run's ranges hold now
    ends = {p: max(o for q, o in held if q == p) + 1 for p in (0, 1)}
    assert len(second) < sum(end - 50 for end in ends.values()), "the cleaner removed records of the next ranges"

    runner.run(pipeline, spark_factory=lambda: spark)

    landed = read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri)
    assert_exactly_once(landed, sorted({(p, o) for p in (0, 1) for o in range(50)} | second))
    # Tombstones the cleaner left are quarantined as such, never dropped.
    errors = query(pipeline.sink.quarantine_uri, "SELECT _kafka_partition, _kafka_offset, error FROM {table}")
    assert {(p, o) for p, o, _ in errors} == {(p, o) for p, o in second if o in (100, 101)}  # the tombstones' offsets
    assert all("tombstone" in error for _, _, error in errors), errors
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.describe()
    assert report.offsets_without_row > 0  # the offsets the cleaner removed: no record, no row


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_a_topic_stored_with_each_codec_is_ingested_exactly_once(codec, broker, make_pipeline, spark):
    topic = f"{codec}_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 3, {"compression.type": codec})  # the broker stores every batch with it
    produced = broker.produce(topic, orders(0, 3_000))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    ids = query(pipeline.sink.table_uri, "SELECT min(id), max(id), count(DISTINCT id) FROM {table}")
    assert ids == [(0, 2_999, 3_000)]


def test_a_record_near_the_brokers_size_limit_goes_through(broker, make_pipeline, spark):
    topic = f"large_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 1)
    (described,) = broker.admin().describe_configs([ConfigResource("topic", topic)]).values()
    limit = int(described.result(timeout=30)["max.message.bytes"].value)
    customer = "x" * (limit - 300)  # a batch of one record: the value, its framing and the batch header
    big = json.dumps({"id": 1, "customer": customer, "amount": 2.5}).encode()
    produced = broker.produce(topic, [(0, None, order(0), None), (0, None, big, None), (0, None, order(2), None)])
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert query(pipeline.sink.table_uri, "SELECT length(customer) FROM {table} WHERE id = 1") == [
        (len(customer),)]


def test_a_broker_killed_mid_run_fails_the_run_naming_its_range_and_the_rerun_is_exact(own_broker, make_pipeline,
                                                                                        spark):
    local = own_broker()
    local.create_topic("killed", 3)
    produced = local.produce("killed", orders(0, 60_000))
    pipeline = make_pipeline("killed", source={"bootstrap_servers": local.bootstrap_servers,
                                               "stall_timeout_seconds": 5},
                             limits={"max_records_per_commit": 3_000})
    main = pipeline.sink.table_uri

    def kill_after_two_commits():
        deadline = time.monotonic() + 120
        while len(read_pairs(main)) < 6_000 and time.monotonic() < deadline:
            time.sleep(0.05)
        local.kill()  # SIGKILL: nothing flushed, no controlled shutdown

    killer = threading.Thread(target=kill_after_two_commits)
    killer.start()
    with pytest.raises(Exception) as failure:
        runner.run(pipeline, spark_factory=lambda: spark)
    killer.join()
    # One line, naming the partition and offsets where reading stopped, and why.
    message = str(failure.value)
    assert "\n" not in message and "pipeline orders" in message and "killed/" in message, message
    assert "unreachable" in message or "cannot reach Kafka" in message, message
    committed = read_pairs(main)
    assert 6_000 <= len(committed) < 60_000
    assert_exactly_once(committed, [(p, o) for p, o in produced if (p, o) in set(committed)])

    local.restart()
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(main), produced)
    assert verify(pipeline, lambda: spark).ok


def test_an_idempotent_producer_retrying_through_a_broker_crash_lands_each_record_once(own_broker, make_pipeline,
                                                                                      spark):
    local = own_broker()
    local.create_topic("retried", 3)
    producer = Producer({**local._client_config(), "enable.idempotence": True, "linger.ms": 5,
                         "message.timeout.ms": 120_000, "retry.backoff.ms": 100})
    delivered, failed = [], []

    def on_delivery(error, message):
        (failed if error else delivered).append(str(error) if error else (message.partition(), message.offset()))

    def crash_midway():
        while len(delivered) < 5_000:
            time.sleep(0.01)
        local.kill()  # batches in flight: the producer retries them against the restarted broker
        local.restart()

    crasher = threading.Thread(target=crash_midway)
    crasher.start()
    for i in range(30_000):
        while True:
            try:
                producer.produce("retried", key=str(i).encode(), value=order(i), partition=i % 3, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(180) == 0
    crasher.join()
    assert not failed and len(delivered) == 30_000

    pipeline = make_pipeline("retried", source={"bootstrap_servers": local.bootstrap_servers})
    runner.run(pipeline, spark_factory=lambda: spark)

    # Kafka holds each record once (the broker dropped the retried duplicates), and so does the table.
    assert held_offsets(local, "retried", 3) == sorted(delivered)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), sorted(delivered))
    ids = query(pipeline.sink.table_uri, "SELECT count(DISTINCT id), count(*) FROM {table}")
    assert ids == [(30_000, 30_000)]


def test_a_run_right_after_a_topic_grows_waits_out_its_new_leaders(broker, make_pipeline, spark):
    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = f"fresh_{uuid.uuid4().hex[:8]}"
    broker.create_topic(topic, 3)
    produced = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    # A client of its own, which does not wait for the leaders (DevBroker's does): Kafka acknowledges
    # new partitions before their leader serves them, and ListOffsets in between fails retriably.
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for done in admin.create_partitions([NewPartitions(topic, 60)]).values():
        done.result(timeout=30)

    report = runner.run(pipeline, spark_factory=lambda: spark)  # planned at once

    assert len(report.plan.bounds) == 60
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
