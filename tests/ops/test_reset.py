"""`oncemore reset` beside everything else that commits: a run committing while a reset prepares is
never undone, a reset's record states the positions it really moved from (and `verify` fails one
that does not), a take-over takes only the topics it names, and a topic's first positions set by a
reset start its other partitions where a run would have. Counted by (topic, partition, offset)."""

from __future__ import annotations

import uuid

import pytest

from conftest import (
    assert_exactly_once,
    by_partition,
    held_positions,
    keyed,
    orders,
    produced_coordinates,
    read_coordinates,
    read_pairs,
)
from oncemore.commit.committer import commit_positions
from oncemore.config.values import OffsetBound
from oncemore.core.errors import CommitConflict, TableOwned, TopicChanged
from oncemore.ops import reset as reset_module
from oncemore.ops.reset import reset
from oncemore.plan.commitinfo import CommitInfo, Reset
from oncemore.plan.ledger import Ledger, fingerprint
from oncemore.plan.planner import plan_run
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


def positions(pipeline, topic=None) -> dict[int, int | None]:
    return held_positions(pipeline.sink.table_uri, pipeline.name, topic or pipeline.source.topic)


def run_meanwhile(monkeypatch, pipeline, spark, until: str = "latest") -> None:
    """Makes the next reset's table preparation (after it read the positions, before it commits)
    let a whole run of ``pipeline`` land first."""
    prepare = reset_module.ensure_tables

    def prepare_after_a_run(*args):
        runner.run(pipeline, until=OffsetBound.parse(until, allowed=("latest",)), spark_factory=lambda: spark)
        return prepare(*args)

    monkeypatch.setattr(reset_module, "ensure_tables", prepare_after_a_run)


def test_a_reset_racing_a_run_that_moved_its_partition_commits_nothing_and_undoes_nothing(
        broker, topic, make_pipeline, spark, monkeypatch):
    produced = broker.produce(topic, orders(0, 30))  # offsets 0-9 of each partition
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    produced += broker.produce(topic, orders(30, 30))
    run_meanwhile(monkeypatch, pipeline, spark)

    with pytest.raises(CommitConflict, match=rf"positions of pipeline orders moved while the reset was being prepared "
                                             rf"\({topic}/0: expected 10, found 20, the reset moves it to 20\); "
                                             "nothing was committed"):
        reset(pipeline, OffsetBound.parse('{"0": 20}'))

    assert positions(pipeline) == {0: 20, 1: 20, 2: 20}
    monkeypatch.undo()
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "no-op"
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert verify(pipeline, lambda: spark).ok


def test_a_reset_racing_a_run_on_other_partitions_keeps_the_runs_positions_and_records_where_it_moved_from(
        broker, topic, make_pipeline, spark, monkeypatch):
    produced = broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    produced += broker.produce(topic, orders(30, 30))
    run_meanwhile(monkeypatch, pipeline, spark, until='{"1": 20, "2": 20}')

    done = reset(pipeline, OffsetBound.parse('{"0": 15}'))  # skips partition 0's offsets 10-14 on purpose

    assert positions(pipeline) == {0: 15, 1: 20, 2: 20}  # the run's positions of partitions 1 and 2 stand
    assert done["from"] == keyed(topic, {0: 10}) and done["to"] == keyed(topic, {0: 15})
    record = Ledger(pipeline.sink.table_uri, "orders").recent_commits(1)[0].record
    assert record.reset.from_positions == {topic: {"0": 10}} and record.reset.to_positions == {topic: {"0": 15}}
    monkeypatch.undo()
    runner.run(pipeline, spark_factory=lambda: spark)
    skipped = [(0, o) for o in range(10, 15)]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), sorted(set(produced) - set(skipped)))
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.describe()


def test_verify_fails_a_reset_record_that_misstates_where_it_moved_from(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    produced += broker.produce(topic, orders(30, 30))
    runner.run(pipeline, spark_factory=lambda: spark)  # partition 1 left at 20
    # What a reset racing that run used to commit: partition 1 "deliberately" put at 10, "from 10".
    ledger = Ledger(pipeline.sink.table_uri, "orders")
    version = commit_positions(ledger, keyed(topic, {1: 10}), CommitInfo(
        pipeline="orders", run_id="stale-reset", reset=Reset({topic: {"1": 10}}, {topic: {"1": 10}}, '{"1": 10}')))
    runner.run(pipeline, spark_factory=lambda: spark)  # ingests partition 1's offsets 10-19 again
    assert len(read_pairs(pipeline.sink.table_uri)) == len(produced) + 10

    report = verify(pipeline, lambda: spark)

    assert not report.ok and report.counts["history"] == 1
    assert (f"history: {topic}/1 [10, 20) (version 2, {version}): reset {version} says it moved the partition from 10, "
            "where commit 2 left it at 20") in report.describe()


def test_a_take_over_takes_only_its_topics_and_no_commit_takes_back_a_topic_handed_over_meanwhile(
        broker, make_pipeline, spark):
    a, b = f"a_{uuid.uuid4().hex[:8]}", f"b_{uuid.uuid4().hex[:8]}"
    for name in (a, b):
        broker.create_topic(name, 3)
    produced = {a: produced_coordinates(a, broker.produce(a, orders(0, 30))),
                b: produced_coordinates(b, broker.produce(b, orders(0, 30)))}
    first = make_pipeline(None, name="first", source={"topic": None, "topics": [a, b]})
    runner.run(first, spark_factory=lambda: spark)
    produced[a] += produced_coordinates(a, broker.produce(a, orders(30, 30)))
    # A plan of first's that moves topic a only, made before topic b is handed over...
    only_a = plan_run(first, OffsetBound.parse(f'{{"{a}": {{"0": 20, "1": 20, "2": 20}}}}'))
    second = make_pipeline(b, name="second", sink={"table_uri": first.sink.table_uri,
                                                  "quarantine_uri": first.sink.quarantine_uri})
    reset(second, OffsetBound("latest"), take_over=True)
    main = Ledger(first.sink.table_uri, "first")
    assert main.claims(b).owner == fingerprint("second")

    # ... commits after it without taking topic b back; so does first's own take-over of topic a.
    runner.run(first, plan=only_a, spark_factory=lambda: spark)
    assert main.claims(b).owner == fingerprint("second")
    reset(first, OffsetBound("latest"), topics=[a], take_over=True)
    assert main.claims(b).owner == fingerprint("second") and main.claims(a).owner == fingerprint("first")

    produced[b] += produced_coordinates(b, broker.produce(b, orders(30, 30)))
    runner.run(second, spark_factory=lambda: spark)  # topic b is second's: its runs go on
    with pytest.raises(TableOwned, match=rf"topic {b} is ingested into .* by pipeline second"):
        runner.run(first, spark_factory=lambda: spark)
    landed = read_coordinates(first.sink.table_uri)
    assert_exactly_once([c for c in landed if c[0] == a], produced[a])
    assert_exactly_once([c for c in landed if c[0] == b], produced[b])


def test_a_partial_reset_of_a_new_topic_starts_its_other_partitions_at_starting_offsets(
        broker, topic, make_pipeline, spark):
    old = broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic, source={"starting_offsets": "latest"})

    done = reset(pipeline, OffsetBound.parse('{"0": 5}'))  # the topic's first positions

    assert done["to"] == keyed(topic, {0: 5, 1: 10, 2: 10})
    assert positions(pipeline) == {0: 5, 1: 10, 2: 10}
    new = broker.produce(topic, orders(30, 30))
    runner.run(pipeline, spark_factory=lambda: spark)
    expected = [(0, o) for o in by_partition(old)[0][5:]] + new  # partitions 1 and 2 from latest, as configured
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), sorted(expected))


def test_a_reset_of_one_topic_leaves_another_recreated_topic_refused(broker, make_pipeline, spark):
    a, b = f"a_{uuid.uuid4().hex[:8]}", f"b_{uuid.uuid4().hex[:8]}"
    for name in (a, b):
        broker.create_topic(name, 3)
    broker.produce(a, orders(0, 30))
    broker.produce(b, orders(0, 30))
    pipeline = make_pipeline(None, name="pair", source={"topic": None, "topics": [a, b]})
    runner.run(pipeline, spark_factory=lambda: spark)
    broker.delete_topic(b)
    broker.create_topic(b, 3)
    broker.produce(b, orders(0, 60))  # more than before: the old positions fit the new log

    reset(pipeline, OffsetBound("latest"), topics=[a])

    with pytest.raises(TopicChanged, match=rf"pipeline pair: topic {b}: the topic was deleted and recreated"):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert positions(pipeline, b) == {0: 10, 1: 10, 2: 10}


def test_a_reset_of_one_topic_stamps_no_other_topics_cluster(broker, make_pipeline, spark):
    from deltalake import CommitProperties, DeltaTable, Transaction

    from oncemore.plan.ledger import identity_app_id

    a, b = f"a_{uuid.uuid4().hex[:8]}", f"b_{uuid.uuid4().hex[:8]}"
    for name in (a, b):
        broker.create_topic(name, 3)
        broker.produce(name, orders(0, 30))
    pipeline = make_pipeline(None, name="pair", source={"topic": None, "topics": [a, b]})
    runner.run(pipeline, spark_factory=lambda: spark)
    # Topic b's positions were committed reading another cluster (the pipeline was pointed elsewhere).
    table = DeltaTable(pipeline.sink.table_uri)
    table.create_write_transaction([], mode="append", schema=table.schema(), commit_properties=CommitProperties(
        app_transactions=[Transaction(identity_app_id("pair", b, "cluster_id"), fingerprint("elsewhere"))]))

    reset(pipeline, OffsetBound("latest"), topics=[a])

    ledger = Ledger(pipeline.sink.table_uri, "pair")
    assert ledger.claims(b).cluster_id == fingerprint("elsewhere")
    with pytest.raises(TopicChanged, match=rf"pipeline pair: topic {b}: the positions were committed .* offsets of "
                                           "another cluster mean nothing here"):
        runner.run(pipeline, spark_factory=lambda: spark)


def test_a_reset_forward_keeps_the_quarantine_floor_ahead_of_it(broker, topic, make_pipeline, spark,
                                                                crash_before_main_commit):
    records = orders(0, 90)
    records[46] = (records[46][0], records[46][1], b"{broken", None)  # partition 1, offset 15
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)
    crash_before_main_commit(pipeline, spark)  # the quarantine table holds partition 1 up to 30, the main none
    assert held_positions(pipeline.sink.quarantine_uri, "orders", topic, [1]) == {1: 30}

    reset(pipeline, OffsetBound.parse('{"1": 10}'))  # partition 1's offsets 0-9 skipped on purpose

    assert held_positions(pipeline.sink.quarantine_uri, "orders", topic, [1]) == {1: 30}
    runner.run(pipeline, spark_factory=lambda: spark)
    quarantined = read_pairs(pipeline.sink.quarantine_uri)
    assert quarantined == [(1, 15)]  # once: written by the crashed batch, not again by the run after the reset
    skipped = [(1, o) for o in range(10)]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri) + quarantined, sorted(set(produced) - set(skipped)))
