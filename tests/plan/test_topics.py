"""Several topics into one table: `source.topics` and `source.topic_pattern` (re-resolved by every
run). Positions, topic identity, data loss and reset are per (topic, partition); `_kafka_topic`
says where each row came from; counted by (topic, partition, offset)."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from conftest import assert_exactly_once, held_positions, orders, produced_coordinates, read_coordinates
from oncemore.commit.groupmirror import group_id
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import PlanError, TopicChanged
from oncemore.ops.reset import reset
from oncemore.report.status import status
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


def test_a_list_of_topics_lands_in_one_table_each_record_once(broker, make_pipeline, spark):
    broker.create_topic("multi_orders", 3)
    broker.create_topic("multi_refunds", 2)
    produced = (produced_coordinates("multi_orders", broker.produce("multi_orders", orders(0, 300)))
                + produced_coordinates("multi_refunds", broker.produce("multi_refunds", orders(0, 100, partitions=2))))
    pipeline = make_pipeline(None, source={"topic": None, "topics": ["multi_orders", "multi_refunds"]},
                             commit_consumer_group=True, limits={"max_records_per_commit": 150})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 400 and len(report.batches) == 3
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri), produced)
    assert held_positions(pipeline.sink.table_uri, "orders", "multi_refunds", [0, 1]) == {0: 50, 1: 50}
    rows = status(pipeline)["partitions"]
    assert sorted((r["topic"], r["partition"], r["position"], r["lag"]) for r in rows) == [
        ("multi_orders", 0, 100, 0), ("multi_orders", 1, 100, 0), ("multi_orders", 2, 100, 0),
        ("multi_refunds", 0, 50, 0), ("multi_refunds", 1, 50, 0)]
    from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition

    request = ConsumerGroupTopicPartitions(group_id(pipeline), [TopicPartition("multi_refunds", p) for p in (0, 1)])
    (future,) = broker.admin().list_consumer_group_offsets([request]).values()
    assert {tp.partition: tp.offset for tp in future.result(timeout=30).topic_partitions} == {0: 50, 1: 50}

    # Explicit offsets name their topic; the other topic keeps its positions.
    reset(pipeline, OffsetBound.parse('{"multi_refunds": {"1": 40}}'))
    runner.run(pipeline, spark_factory=lambda: spark)
    again = [c for c in read_coordinates(pipeline.sink.table_uri) if c[0] == "multi_refunds" and c[1] == 1 and c[2] >= 40]
    assert len(again) == 20, "the deliberate replay of multi_refunds/1 [40, 50) and nothing else"
    with pytest.raises(PlanError, match="name the topic of each offset"):
        reset(pipeline, OffsetBound.parse('{"1": 40}'))


def test_a_pattern_picks_up_new_topics_at_their_starting_offsets_and_never_others(broker, make_pipeline, spark):
    prefix = f"pat{time.time_ns() % 10**9}"
    broker.create_topic(f"{prefix}.eu", 2)
    broker.create_topic(f"{prefix}_other", 2)
    produced = produced_coordinates(f"{prefix}.eu", broker.produce(f"{prefix}.eu", orders(0, 60, partitions=2)))
    broker.produce(f"{prefix}_other", orders(0, 60, partitions=2))
    pipeline = make_pipeline(None, source={"topic": None, "topic_pattern": f"{prefix}\\..*"})

    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri), produced)

    broker.create_topic(f"{prefix}.us", 3)  # matches: ingested from starting_offsets (earliest) by the next run
    produced += produced_coordinates(f"{prefix}.us", broker.produce(f"{prefix}.us", orders(0, 90)))
    produced += produced_coordinates(f"{prefix}.eu", broker.produce(f"{prefix}.eu", orders(60, 20, partitions=2)))
    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 110
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri), produced)
    assert sorted(report.plan.topics) == [f"{prefix}.eu", f"{prefix}.us"]


def test_a_pattern_whose_topics_are_all_replaced_goes_on_with_the_new_ones_and_status_names_the_gone(
        broker, make_pipeline, spark):
    prefix = f"rot{time.time_ns() % 10**9}"
    first = f"{prefix}.a"
    broker.create_topic(first, 2)
    produced = produced_coordinates(first, broker.produce(first, orders(0, 40, partitions=2)))
    pipeline = make_pipeline(None, name="rotating", source={"topic": None, "topic_pattern": f"{prefix}\\..*",
                                                             "starting_offsets": "earliest"})
    runner.run(pipeline, spark_factory=lambda: spark)
    gone = {}
    for old, new in ((first, f"{prefix}.b"), (f"{prefix}.b", f"{prefix}.c")):  # rotated twice
        broker.delete_topic(old)
        time.sleep(0.5)
        broker.create_topic(new, 3)
        produced += produced_coordinates(new, broker.produce(new, orders(0, 30)))

        report = runner.run(pipeline, spark_factory=lambda: spark)  # refused as "positions missing" before

        assert report.plan.topics == (new,) and report.written == 30
        gone[old] = {"why": "deleted", "positions": {"0": 20, "1": 20} if old == first else {"0": 10, "1": 10, "2": 10}}
        assert status(pipeline)["gone"] == gone
    assert_exactly_once(read_coordinates(pipeline.sink.table_uri), produced)
    assert verify(pipeline, lambda: spark).ok


def test_one_recreated_topic_of_two_stops_the_run_naming_it_and_its_reset_leaves_the_other(broker, make_pipeline,
                                                                                            spark):
    broker.create_topic("multi_a", 2)
    broker.create_topic("multi_b", 2)
    produced = produced_coordinates("multi_a", broker.produce("multi_a", orders(0, 20, partitions=2)))
    old_b = produced_coordinates("multi_b", broker.produce("multi_b", orders(0, 20, partitions=2)))
    pipeline = make_pipeline(None, name="recreated", source={"topic": None, "topics": ["multi_a", "multi_b"]})
    runner.run(pipeline, spark_factory=lambda: spark)
    broker.delete_topic("multi_b")
    broker.create_topic("multi_b", 2)
    new_b = produced_coordinates("multi_b", broker.produce("multi_b", orders(0, 40, partitions=2)))
    produced += produced_coordinates("multi_a", broker.produce("multi_a", orders(20, 10, partitions=2)))

    with pytest.raises(TopicChanged, match="pipeline recreated: topic multi_b: the topic was deleted and recreated"
                                           r".*`oncemore reset recreated --topic multi_b --to earliest`"):
        runner.run(pipeline, spark_factory=lambda: spark)
    # The reset the error names moves multi_b alone: multi_a is not read again.
    done = reset(pipeline, OffsetBound("earliest"), topics=["multi_b"])
    assert done["to"] == {KafkaPartition("multi_b", 0): 0, KafkaPartition("multi_b", 1): 0}
    assert held_positions(pipeline.sink.table_uri, "recreated", "multi_a", [0, 1]) == {0: 10, 1: 10}
    runner.run(pipeline, spark_factory=lambda: spark)
    landed = Counter(read_coordinates(pipeline.sink.table_uri))
    assert landed == Counter(produced) + Counter(old_b) + Counter(new_b)  # the old topic's rows stay
    with pytest.raises(PlanError, match="topic multi_a is not among the ones reset"):
        reset(pipeline, OffsetBound.parse('{"multi_a": {"0": 0}}'), topics=["multi_b"])


def test_one_topic_feeding_two_pipelines_does_not_interfere(broker, topic, make_pipeline, spark):
    produced = produced_coordinates(topic, broker.produce(topic, orders(0, 300)))
    first = make_pipeline(topic, name="first")
    second = make_pipeline(topic, name="second", limits={"max_records_per_commit": 70})

    runner.run(first, until=OffsetBound.parse(json.dumps({"0": 50, "1": 50, "2": 50})), spark_factory=lambda: spark)
    runner.run(second, spark_factory=lambda: spark)
    runner.run(first, spark_factory=lambda: spark)

    assert_exactly_once(read_coordinates(first.sink.table_uri), produced)
    assert_exactly_once(read_coordinates(second.sink.table_uri), produced)
    assert held_positions(first.sink.table_uri, "first", topic) == held_positions(second.sink.table_uri, "second", topic)
