"""Timestamp bounds on Apache Kafka: a range ends at the first *data* record stamped at or
after the bound, whatever transaction markers (stamped with the broker's clock) say; out-of-order
records go with the next range; a future-stamped record blocking older ones fails the run.

Out-of-order data here is produced so that each batch's maximum timestamp is at least the one
before it: the test broker finds a timestamp by binary search over batches' maximum timestamps,
which Kafka's time index (maximum timestamp *so far*) does not need; its answer is only trusted
as Kafka guarantees it, a lower bound.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from confluent_kafka import Producer

from conftest import allow_any_timestamp, assert_exactly_once, by_partition, keyed, order, read_pairs
from oncemore.config.values import OffsetBound
from oncemore.core.errors import BoundStalled
from oncemore.kafka import clients
from oncemore.plan.planner import plan_run
from oncemore.run import runner

pytestmark = pytest.mark.spark
HOUR = 3_600_000
# Yesterday's midnight (UTC): backdated, yet within the broker's 7 days of time retention, which
# deletes a closed segment of older records (a far-future record rolls one) whatever the test meant.
BASE_TIME = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=1)
BASE = int(BASE_TIME.timestamp() * 1000)


def iso(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def at(hour: float) -> OffsetBound:
    return OffsetBound(kind="timestamp", timestamp_ms=BASE + int(hour * HOUR))


def test_backdated_records_inside_transactions_end_each_range_at_its_first_newer_record(broker, topic, make_pipeline, spark):
    # Each hour's records are sent now, in one transaction per hour: their markers carry today's
    # clock, so Kafka answers "the first offset at or after 02:00" with hour 0's marker.
    hours = [broker.produce(topic, [(i % 3, None, order(h * 100 + i), BASE + h * HOUR + i * 60_000) for i in range(30)],
                            transactional_id="backfill") for h in range(4)]
    pipeline = make_pipeline(topic)
    admin = clients.admin_client(pipeline)
    first_of_hour_2 = {p: min(offsets) for p, offsets in by_partition(hours[2]).items()}
    markers = {p: {max(offsets) + 1 for h in hours for q, offsets in by_partition(h).items() if q == p} for p in range(3)}
    answered = {p.partition: o for p, o in clients.offsets_for_timestamp(
        admin, pipeline, at(2).timestamp_ms, keyed(topic, {0: 0, 1: 0, 2: 0})).items()}
    assert all(answered[p] in markers[p] and answered[p] < first_of_hour_2[p] for p in range(3)), answered

    assert plan_run(pipeline, at(2)) == plan_run(pipeline, at(2)), "the same log and bound give the same plan"
    landed = []
    for h in (1, 2, 3):
        report = runner.run(pipeline, until=at(h), spark_factory=lambda: spark)
        landed += hours[h - 1]
        assert report.written == 30, f"hour {h - 1}: the run ingests exactly that hour"
        assert_exactly_once(read_pairs(pipeline.sink.table_uri), landed)
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), landed + hours[3])


def test_a_start_by_timestamp_also_skips_markers_to_the_first_data_record(broker, topic, make_pipeline, spark):
    hours = [broker.produce(topic, [(i % 3, None, order(h * 100 + i), BASE + h * HOUR + i) for i in range(9)],
                            transactional_id="backfill") for h in range(3)]
    pipeline = make_pipeline(topic, source={"starting_offsets": {"timestamp": iso(BASE + HOUR)}})
    runner.run(pipeline, until=at(2), spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), hours[1])


def test_out_of_order_records_go_with_the_range_of_the_first_record_after_the_bound(broker, topic, make_pipeline, spark):
    minutes = [0, 30, 65, 50, 70]  # offset 3 is stamped 00:50 but arrives after 01:05
    produced = broker.produce(topic, [(0, None, order(m), BASE + m * 60_000) for m in minutes])
    pipeline = make_pipeline(topic)
    offsets = by_partition(produced)[0]

    runner.run(pipeline, until=at(1), spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), [(0, o) for o in offsets[:2]])
    runner.run(pipeline, until=at(2), spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), [(0, o) for o in offsets])


def test_a_future_stamped_record_blocking_older_ones_fails_the_run_naming_them(broker, topic, make_pipeline, spark):
    year_2100 = int(datetime(2100, 1, 1, tzinfo=timezone.utc).timestamp() * 1000)
    allow_any_timestamp(broker, topic)
    first = broker.produce(topic, [(0, None, order(0), BASE)])
    blocker = broker.produce(topic, [(0, None, order(1), year_2100)])
    behind = broker.produce(topic, [(0, None, order(2), BASE + 40 * 60_000), (0, None, order(3), year_2100 + 1)])
    pipeline = make_pipeline(topic)
    runner.run(pipeline, until=at(0.5), spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), first)

    with pytest.raises(BoundStalled) as stalled:
        runner.run(pipeline, until=at(1), spark_factory=lambda: spark)
    message = str(stalled.value)
    assert f"{topic}/0: the record at offset {blocker[0][1]} (the position) is stamped 2100-01-01T00:00:00Z" in message
    assert f"offset {behind[0][1]} behind it is stamped {iso(BASE + 40 * 60_000)}" in message
    assert f"pipeline orders: {topic}/0:" in message and "--until latest" in message
    assert stalled.value.evidence["position"] == blocker[0][1]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), first)
    # What the message says to do gets past it.
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), first + blocker + behind)


def test_a_past_stamped_record_ahead_of_older_ones_waits_for_the_next_range(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, [(0, None, order(0), BASE)])
    produced += broker.produce(topic, [(0, None, order(1), BASE + 90 * 60_000)])
    produced += broker.produce(topic, [(0, None, order(2), BASE + 50 * 60_000), (0, None, order(3), BASE + 150 * 60_000)])
    pipeline = make_pipeline(topic)
    runner.run(pipeline, until=at(0.5), spark_factory=lambda: spark)
    report = runner.run(pipeline, until=at(1), spark_factory=lambda: spark)
    assert report.status == "no-op", "01:30 comes first: nothing of this partition is before 01:00 in log order"
    runner.run(pipeline, until=at(2), spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced[:3])


def test_an_open_transaction_holds_the_end_at_the_last_stable_offset(broker, topic, make_pipeline, spark):
    committed = broker.produce(topic, [(0, None, order(i), None) for i in range(20)])
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "transactional.id": "open"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(10):
        producer.produce(topic, order(100 + i), partition=0)
    producer.flush(30)
    later = broker.produce(topic, [(0, None, order(200 + i), None) for i in range(5)])
    pipeline = make_pipeline(topic)

    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), committed)
    producer.commit_transaction(30)
    runner.run(pipeline, spark_factory=lambda: spark)
    pairs = read_pairs(pipeline.sink.table_uri)
    assert len(pairs) == 35 and set(committed + later) <= set(pairs)
    assert_exactly_once(pairs, sorted(set(pairs)))


def test_a_bound_in_the_future_reads_to_the_log_end(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, [(p, None, order(p), None) for p in range(3)])
    pipeline = make_pipeline(topic)
    tomorrow = datetime.now(timezone.utc) + timedelta(days=1)
    runner.run(pipeline, until=OffsetBound(kind="timestamp", timestamp_ms=int(tomorrow.timestamp() * 1000)),
               spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
