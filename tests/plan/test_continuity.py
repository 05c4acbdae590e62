"""Positions only ever continue on the topic they were committed for: a recreated topic, another
cluster, lost positions or a stale plan stop the run before anything is read; a deliberate reset
is a commit of its own; checkpoints, compaction and vacuum leave positions alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
from deltalake import DeltaTable

from conftest import ROOT, assert_exactly_once, by_partition, held_positions, keyed, orders, read_pairs
from oncemore.commit.committer import commit_positions
from oncemore.commit.tables import ensure_tables
from oncemore.config.values import OffsetBound
from oncemore.core.errors import PositionsMissing, StalePlan, TableOwned, TopicChanged
from oncemore.kafka import clients
from oncemore.ops.reset import reset
from oncemore.plan import ledger
from oncemore.plan.commitinfo import METADATA_KEY, CommitInfo
from oncemore.plan.ledger import RECENT_HISTORY, Ledger
from oncemore.plan.planner import plan_run
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


def no_spark():
    raise AssertionError("this run must not start Spark")


def positions(pipeline) -> dict[int, int | None]:
    return held_positions(pipeline.sink.table_uri, pipeline.name, pipeline.source.topic)


def last_record(table_uri: str) -> CommitInfo:
    return CommitInfo.from_json(DeltaTable(table_uri).history(1)[0][METADATA_KEY])


def test_a_recreated_topic_stops_the_run_until_a_deliberate_reset(broker, topic, make_pipeline, spark):
    old = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    broker.delete_topic(topic)
    broker.create_topic(topic, 3)
    new = broker.produce(topic, orders(300, 600))  # more records than before: the old positions fit the new log

    with pytest.raises(TopicChanged, match=rf"pipeline orders: topic {topic}: the topic was deleted and recreated"):
        runner.run(pipeline, spark_factory=no_spark)
    version = DeltaTable(pipeline.sink.table_uri).version()

    said = subprocess.run([sys.executable, "-m", "oncemore.cli", "reset", "--config", pipeline.origin, "--to", "earliest",
                           "--dry-run"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "include")})
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith("orders: positions would be reset from {") and "nothing committed" in said.stdout
    assert f'to {{"{topic}": {{"0": 0, "1": 0, "2": 0}}}}' in said.stdout
    assert DeltaTable(pipeline.sink.table_uri).version() == version
    done = reset(pipeline, OffsetBound("earliest"))
    assert done["to"] == keyed(topic, {0: 0, 1: 0, 2: 0})
    assert done["from"] == keyed(topic, {p: len(by_partition(old)[p]) for p in (0, 1, 2)})
    record = last_record(pipeline.sink.table_uri)
    assert record.reset.to == "earliest" and record.reset.from_positions == {topic: {str(p.partition): v for p, v in done["from"].items()}}
    assert DeltaTable(pipeline.sink.table_uri).version() == version + 1
    runner.run(pipeline, spark_factory=lambda: spark)
    # The old topic's rows stay; the new topic's records are added once each.
    assert Counter(read_pairs(pipeline.sink.table_uri)) == Counter(old) + Counter(new)


def test_positions_of_another_cluster_stop_the_run(own_broker, make_pipeline, spark):
    first = own_broker()
    first.create_topic("moved", 3)
    first.produce("moved", orders(0, 90))
    pipeline = make_pipeline("moved", source={"bootstrap_servers": first.bootstrap_servers})
    runner.run(pipeline, spark_factory=lambda: spark)
    first.stop()
    second = own_broker()  # another cluster (its own ID) with a topic of the same name, more records
    second.create_topic("moved", 3)
    second.produce("moved", orders(0, 300))
    moved = make_pipeline("moved", source={"bootstrap_servers": second.bootstrap_servers})
    cluster = second.admin().list_topics(timeout=10).cluster_id
    with pytest.raises(TopicChanged, match=rf"reading cluster (?!{cluster})\S+, the broker at .* is cluster {cluster}: "
                                           "offsets of another cluster mean nothing here"):
        runner.run(moved, spark_factory=no_spark)


def test_a_position_beyond_the_log_end_stops_the_run(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    # Another tool moved the positions past the log, recording no topic ID (as a broker without IDs would).
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name)
    commit_positions(ledger, keyed(topic, {0: 500, 1: 10, 2: 10}), CommitInfo(pipeline="orders", run_id="tool"))
    with pytest.raises(TopicChanged, match=rf"pipeline orders: {topic}/0: committed position 500 is beyond the log end 10"):
        runner.run(pipeline, spark_factory=no_spark)


def test_expired_positions_are_refused_and_a_reset_from_the_hint_continues_exactly_once(broker, topic, make_pipeline, spark):
    first = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    handed = plan_run(pipeline)  # as Airflow's plan task hands it to the run
    runner.run(pipeline, plan=handed, spark_factory=lambda: spark)
    ends = positions(pipeline)
    DeltaTable(pipeline.sink.table_uri).alter.set_table_properties({"delta.setTransactionRetentionDuration": "interval 1 second"})
    time.sleep(2)
    DeltaTable(pipeline.sink.table_uri).create_checkpoint()
    assert positions(pipeline) == {0: None, 1: None, 2: None}
    more = broker.produce(topic, orders(300, 90))

    hint = json.dumps({topic: {str(p): v for p, v in ends.items()}}, sort_keys=True)
    # A rerun, and a rerun of the first run's plan (its batch built on no position, as the table holds now).
    for plan in (None, handed):
        with pytest.raises(PositionsMissing) as missing:
            runner.run(pipeline, plan=plan, spark_factory=no_spark)
        assert f"left positions at {hint}" in str(missing.value) and "oncemore reset orders" in str(missing.value)

    DeltaTable(pipeline.sink.table_uri).alter.set_table_properties({"delta.setTransactionRetentionDuration": "interval 30 days"})
    reset(pipeline, OffsetBound.parse(hint))
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), first + more)
    # The reset moved the partitions from no position (their txn actions had expired): true, and
    # verify passes it.
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.describe()


def test_planning_reads_no_commit_history_and_before_fingerprints_only_recent_history(broker, topic, make_pipeline,
                                                                                        monkeypatch):
    """DESIGN.md invariant 4: planning reads the snapshot's txn actions, not the commit history."""
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    ensure_tables(pipeline, pipeline.static_columns())
    main = Ledger(pipeline.sink.table_uri, pipeline.name)
    # Commits as oncemore wrote them before the topic's fingerprints were recorded (format < 4): the
    # plan checks the topic against the newest commit record on it.
    for n in range(RECENT_HISTORY + 20):
        commit_positions(main, keyed(topic, {0: 10, 1: 10, 2: 10}), CommitInfo(
            pipeline="orders", run_id=f"old-{n}", ranges={topic: {str(p): [10, 10] for p in (0, 1, 2)}}))
    read = []
    read_commit = ledger._read_commit
    monkeypatch.setattr(ledger, "_read_commit", lambda *args: read.append(args[-1]) or read_commit(*args))
    assert plan_run(pipeline).is_empty
    assert 0 < len(read) <= RECENT_HISTORY, f"{len(read)} commit files read for a plan"

    identity = clients.describe_source(clients.admin_client(pipeline), pipeline).identities[topic]
    commit_positions(main, keyed(topic, {0: 10, 1: 10, 2: 10}), CommitInfo(
        pipeline="orders", run_id="now", topic_ids={topic: identity.topic_id}, cluster_id=identity.cluster_id))
    read.clear()
    assert plan_run(pipeline).is_empty
    assert read == [], "with the fingerprints in the snapshot, a plan reads no commit file"


def test_every_commit_restates_idle_partitions_so_they_do_not_expire(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    # Each commit lands well within the retention of the one before; partitions 1 and 2 stay idle
    # for twice the retention.
    DeltaTable(pipeline.sink.table_uri).alter.set_table_properties({"delta.setTransactionRetentionDuration": "interval 8 seconds"})
    for i in range(4):
        time.sleep(3.5)
        produced += broker.produce(topic, [(0, None, b'{"id": 1}', None)])
        runner.run(pipeline, spark_factory=lambda: spark)
    assert None not in positions(pipeline).values()
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_renamed_pipeline_another_pipelines_table_or_another_tools_is_refused_saying_whose(
        broker, topic, make_pipeline, spark, tmp_path):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    renamed = make_pipeline(topic, name="orders_v2", sink={"table_uri": pipeline.sink.table_uri})
    with pytest.raises(TableOwned, match=rf"topic {topic} is ingested into .* by pipeline orders; .* --take-over"):
        runner.run(renamed, spark_factory=no_spark)

    import pyarrow as pa
    from deltalake import write_deltalake

    foreign = str(tmp_path / "foreign")
    write_deltalake(foreign, pa.table({"id": [1, 2]}))
    other = make_pipeline(topic, name="other", sink={"table_uri": foreign})
    with pytest.raises(PositionsMissing, match=r"table .*foreign \(version 0\) holds data that no oncemore pipeline "
                                               r"committed \(another tool wrote it\)"):
        runner.run(other, spark_factory=no_spark)
    # A second pipeline on another topic into the first one's table is told whose table it is.
    broker.create_topic(f"{topic}_other", 3)
    second = make_pipeline(f"{topic}_other", name="second", sink={"table_uri": pipeline.sink.table_uri})
    with pytest.raises(PositionsMissing, match=rf"pipeline second: table {pipeline.sink.table_uri} \(version 1\) "
                                               r"belongs to pipeline orders: its oncemore commits are by orders, none "
                                               r"by second\. A table belongs to one pipeline: point second's "
                                               r"sink\.table_uri at a table of its own\.$"):
        runner.run(second, spark_factory=no_spark)


def test_checkpoint_compaction_and_vacuum_keep_the_positions(broker, topic, make_pipeline, spark):
    produced = []
    pipeline = make_pipeline(topic)
    for start in range(0, 600, 150):  # several small commits: files to compact
        produced += broker.produce(topic, orders(start, 150))
        runner.run(pipeline, spark_factory=lambda: spark)
    before = positions(pipeline)
    table = DeltaTable(pipeline.sink.table_uri)
    table.create_checkpoint()
    metrics = DeltaTable(pipeline.sink.table_uri).optimize.compact()
    assert metrics["numFilesRemoved"] > metrics["numFilesAdded"] >= 1
    DeltaTable(pipeline.sink.table_uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    assert positions(pipeline) == before
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)

    produced += broker.produce(topic, orders(600, 90))
    assert runner.run(pipeline, spark_factory=lambda: spark).written == 90
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_plan_the_table_already_holds_is_a_noop_without_spark(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 100})
    plan = plan_run(pipeline)
    runner.run(pipeline, plan=plan, spark_factory=lambda: spark)
    version = DeltaTable(pipeline.sink.table_uri).version()

    again = runner.run(pipeline, plan=plan, spark_factory=no_spark)  # a retried ingest task
    assert again.status == "no-op" and "the table already holds this plan" in again.summary()
    assert DeltaTable(pipeline.sink.table_uri).version() == version
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_partly_committed_plan_runs_only_its_remainder(broker, topic, make_pipeline, spark, monkeypatch):
    produced = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 100})
    plan = plan_run(pipeline)
    assert len(plan.batches) == 3
    real_ingest = runner._Run.ingest

    def crash_after_first(self, batch):
        if batch.seq == 1:
            raise SystemExit("injected crash after batch 0 committed")
        return real_ingest(self, batch)

    monkeypatch.setattr(runner._Run, "ingest", crash_after_first)
    with pytest.raises(SystemExit):
        runner.run(pipeline, plan=plan, spark_factory=lambda: spark)
    monkeypatch.undo()
    # Another run moves partition 0 into the middle of batch 1 meanwhile.
    middle = {(topic, 0): plan.batches[1].ranges[0].start + 5}
    runner.run(pipeline, until=OffsetBound("offsets", offsets=middle), spark_factory=lambda: spark)

    retried = runner.run(pipeline, plan=plan, spark_factory=lambda: spark)
    assert [b.status for b in retried.batches] == ["already_committed", "committed", "committed"]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_stale_or_foreign_plan_is_refused_before_anything_is_read(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 90))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    broker.produce(topic, orders(90, 90))
    plan = plan_run(pipeline)
    reset(pipeline, OffsetBound.parse('{"0": 10}'))  # positions moved behind the plan
    with pytest.raises(StalePlan, match=rf"pipeline orders: {topic}/0: the plan's batch 0 builds on position 30 .* holds position 10"):
        runner.run(pipeline, plan=plan, spark_factory=no_spark)

    other_topic = make_pipeline(f"{topic}_other", name="orders")
    with pytest.raises(StalePlan, match=rf"the plan is for topic {topic}, the pipeline's is topic {topic}_other"):
        runner.run(other_topic, plan=plan, spark_factory=no_spark)
    other_table = make_pipeline(topic, name="orders", sink={"table_uri": "/tmp/elsewhere"})
    with pytest.raises(StalePlan, match="the plan is for table"):
        runner.run(other_table, plan=plan, spark_factory=no_spark)


def test_a_recreated_topic_is_caught_when_the_pipelines_last_commit_is_far_back(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    # A busy shared table: the pipeline's last commit ends up behind more than 100 others.
    neighbour = Ledger(pipeline.sink.table_uri, "neighbour")
    for n in range(105):
        commit_positions(neighbour, keyed("elsewhere", {0: n + 1}), CommitInfo(pipeline="neighbour", run_id=f"n-{n}"))
    broker.delete_topic(topic)
    broker.create_topic(topic, 3)
    broker.produce(topic, orders(0, 300))  # more records than the positions: they fit the new log

    with pytest.raises(TopicChanged, match=rf"pipeline orders: topic {topic}: the topic was deleted and recreated"):
        runner.run(pipeline, spark_factory=no_spark)


def test_a_partial_reset_keeps_the_quarantine_floor_of_unnamed_partitions(broker, topic, make_pipeline, spark,
                                                                           crash_before_main_commit):
    records = orders(0, 90)
    records[4] = (records[4][0], records[4][1], b"{broken", None)  # partition 1, offset 1
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)
    crash_before_main_commit(pipeline, spark)
    assert held_positions(pipeline.sink.quarantine_uri, "orders", topic, [1]) == {1: 30}

    reset(pipeline, OffsetBound.parse('{"0": 0}'))  # names partition 0 only

    assert held_positions(pipeline.sink.quarantine_uri, "orders", topic) == {0: 0, 1: 30, 2: None}
    runner.run(pipeline, spark_factory=lambda: spark)
    main_pairs, quarantine_pairs = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert quarantine_pairs == [(1, 1)]
    assert_exactly_once(main_pairs + quarantine_pairs, produced)


def test_a_second_pipeline_on_a_table_is_refused_even_after_a_reset_unless_it_takes_over(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 60))
    first = make_pipeline(topic)
    runner.run(first, spark_factory=lambda: spark)
    second = make_pipeline(topic, name="second", sink={"table_uri": first.sink.table_uri,
                                                       "quarantine_uri": first.sink.quarantine_uri})

    with pytest.raises(TableOwned, match=r"ingested into .* by pipeline orders"):
        runner.run(second, spark_factory=no_spark)
    with pytest.raises(TableOwned, match=r"--take-over"):  # the advice of old led to duplicates
        reset(second, OffsetBound("latest"))
    more = broker.produce(topic, orders(60, 30))
    runner.run(first, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(first.sink.table_uri), produced + more)

    reset(second, OffsetBound("latest"), take_over=True)  # a deliberate hand-over
    with pytest.raises(TableOwned, match=r"ingested into .* by pipeline second"):
        runner.run(first, spark_factory=no_spark)
    last = broker.produce(topic, orders(90, 30))
    runner.run(second, spark_factory=lambda: spark)
    assert_exactly_once(read_pairs(first.sink.table_uri), produced + more + last)
