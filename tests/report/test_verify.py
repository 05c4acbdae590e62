"""``oncemore verify`` audits exactly-once from the tables alone: an exact table verifies (through
compaction and vacuum, on S3, after a rewinding reset, with a batch half committed), and every kind
of fault planted in one is named with its topic, partition, offsets and versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from conftest import ROOT, oncemore_commits, orders, read_pairs
from oncemore.config.values import OffsetBound
from oncemore.ops.maintain import maintain
from oncemore.plan.ledger import app_id
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark


def malformed_every(records, step: int):
    return [(p, k, b"{not json" if i % step == 0 else v, h) for i, (p, k, v, h) in enumerate(records)]


def test_an_exact_table_verifies_through_compaction_and_vacuum_and_the_cli_says_so(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, malformed_every(orders(0, 1_500), 50))
    produced += broker.produce(topic, orders(1_500, 300), transactional_id="verify")  # markers hold offsets
    pipeline = make_pipeline(topic, transform="SELECT * FROM records WHERE id % 7 <> 0",
                             limits={"max_records_per_commit": 500})
    run = runner.run(pipeline, spark_factory=lambda: spark)
    bad = len(range(0, 1_500, 50))
    assert run.quarantined == bad and len(oncemore_commits(pipeline.sink.table_uri)) >= 4

    report = verify(pipeline, lambda: spark)

    assert report.ok, report.describe()
    assert report.whole_log and report.commits == len(oncemore_commits(pipeline.sink.table_uri))
    assert report.rows["main"] == run.written == len(read_pairs(pipeline.sink.table_uri))
    assert report.rows["quarantine"] == bad and report.rows["pending"] == report.rows["before"] == 0
    filtered = 1_800 - run.written - bad
    assert report.filtered == filtered and report.offsets_without_row == filtered + 3, "3 partitions, 1 marker each"

    maintain(pipeline)  # compaction rewrites every file; vacuum then deletes the old ones
    for uri in (pipeline.sink.table_uri, pipeline.sink.quarantine_uri):
        DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    assert len(DeltaTable(pipeline.sink.table_uri).file_uris()) == 1
    again = verify(pipeline, lambda: spark)
    assert again.ok and (again.rows, again.offsets_without_row) == (report.rows, report.offsets_without_row)

    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    command = [sys.executable, "-m", "oncemore.cli", "verify", "--config", pipeline.origin, "--master", "local[1]"]
    said = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert said.returncode == 0, said.stderr[-3000:]
    assert said.stdout.startswith(f"orders: OK: {report.commits} commits audited (every commit of the log)")
    as_json = json.loads(subprocess.run(command + ["--json"], env=env, capture_output=True, text=True,
                                        timeout=600, check=True).stdout)
    assert as_json["ok"] is True and as_json["rows"] == report.rows


def test_duplicated_lost_and_stray_rows_a_broken_history_and_a_moved_position_are_named(
        broker, topic, make_pipeline, spark, tmp_path):
    broker.produce(topic, orders(0, 600))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 300})
    runner.run(pipeline, spark_factory=lambda: spark)
    uri = pipeline.sink.table_uri
    rows = DeltaTable(uri).to_pyarrow_table()

    def row(partition: int, offset: int) -> pa.Table:
        return rows.filter(pc.and_(pc.equal(rows["_kafka_partition"], partition), pc.equal(rows["_kafka_offset"], offset)))

    stray = row(2, 10)
    at = stray.schema.get_field_index("_kafka_offset")
    stray = stray.set_column(at, stray.schema.field(at), pa.array([10_000], pa.int64()))
    write_deltalake(uri, pa.concat_tables([row(1, 150), stray]), mode="append")  # a duplicate, a row past every range
    DeltaTable(uri).delete("_kafka_partition = 0 AND _kafka_offset = 3")  # a lost row
    table = DeltaTable(uri)
    table.create_write_transaction([], mode="append", schema=table.schema(), commit_properties=CommitProperties(
        app_transactions=[Transaction(app_id("orders", topic, 1), 150)]))  # a position moved behind the log's back

    report = verify(pipeline, lambda: spark)

    assert not report.ok
    found = {d.kind: d for d in report.discrepancies}
    assert set(found) == {"duplicate", "outside", "count", "position"}, report.describe()
    assert (found["duplicate"].topic, found["duplicate"].partition, found["duplicate"].start) == (topic, 1, 150)
    assert (found["outside"].partition, found["outside"].start, found["outside"].end) == (2, 10_000, 10_001)
    assert found["position"].line() == (f"position: {topic}/1 [150, 200) (version {found['position'].versions[0]}): "
                                        "the snapshot holds position 150, the last commit left 200")
    counts = {d.detail.split(" has ")[1].split(";")[0]: d for d in report.discrepancies if d.kind == "count"}
    assert set(counts) == {"299 rows in the main table, its record says 300",
                           "301 rows in the main table, its record says 300"}
    # The writer that removed a row without a record is named by its version (the append is none).
    assert all(f"; rows were removed outside oncemore by version(s) {DeltaTable(uri).version() - 1} (DELETE)"
               in d.detail for d in counts.values()), [d.detail for d in counts.values()]
    # The lost row is named by its partition and offset, read back from Kafka; the commit's first
    # partition (0) and the lost row's partition coincide here, so the offset decides.
    lost = counts["299 rows in the main table, its record says 300"]
    assert (lost.topic, lost.partition) == (topic, 0) and lost.detail.endswith(
        f": offset(s) 3 of {topic}/0 are in Kafka and in neither table"), lost.detail
    assert report.counts["duplicate"] == 1 and report.counts["outside"] == 1

    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    said = subprocess.run([sys.executable, "-m", "oncemore.cli", "verify", "--config", pipeline.origin,
                           "--master", "local[1]"], env=env, capture_output=True, text=True, timeout=600)
    assert said.returncode == 1 and said.stdout.startswith("orders: FAILED"), said.stderr[-3000:]
    assert f"duplicate: {topic}/1 [150, 151)" in said.stdout


def test_a_batch_that_skips_offsets_without_recording_a_gap_breaks_the_history(broker, topic, make_pipeline, spark):
    from oncemore.commit.committer import commit
    from oncemore.core.coordinates import KafkaPartition
    from oncemore.plan.commitinfo import CommitInfo
    from oncemore.plan.ledger import Ledger

    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    runner.run(pipeline, spark_factory=lambda: spark)
    (first, _), = oncemore_commits(pipeline.sink.table_uri)
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name)
    keys = [KafkaPartition(topic, p) for p in range(3)]
    held = ledger.positions(keys)
    p0 = keys[0]
    record = CommitInfo(pipeline="orders", run_id="skipper", ranges={topic: {"0": [held[p0] + 5, held[p0] + 5]}},
                          records={"written": 0, "quarantined": 0, "filtered": 0})
    version = commit(ledger, [], {p0: held[p0]}, {p0: held[p0] + 5}, keys, record).version

    report = verify(pipeline, lambda: spark)

    assert [d.line() for d in report.discrepancies] == [
        f"history: {topic}/0 [100, 105) (version {first}, {version}): commit {version} starts at 105, where commit "
        f"{first} left the partition at 100"]


def test_a_half_committed_batch_is_pending_and_a_rewound_partition_is_ingested_twice_by_right(
        broker, topic, make_pipeline, spark, crash_before_main_commit):
    from oncemore.ops.reset import reset

    records = orders(0, 900)
    records[10] = (records[10][0], records[10][1], b"{broken", None)
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)
    crash_before_main_commit(pipeline, spark)

    pending = verify(pipeline, lambda: spark)
    assert pending.ok and pending.rows["pending"] == 1 and pending.commits == 0, pending.describe()

    runner.run(pipeline, spark_factory=lambda: spark)
    reset(pipeline, OffsetBound.parse('{"1": 100}'))  # partition 1 ingested again from offset 100
    runner.run(pipeline, spark_factory=lambda: spark)
    twice = [(p, o) for p, o in produced if p == 1 and o >= 100]
    assert len(read_pairs(pipeline.sink.table_uri)) == 899 + len(twice)

    report = verify(pipeline, lambda: spark)

    assert report.ok, report.describe()
    assert (report.rows["main"], report.rows["quarantine"], report.rows["pending"]) == (899 + len(twice), 1, 0)
    rewound = [v for v, r in oncemore_commits(pipeline.sink.table_uri) if r.reset is not None][0]
    since = verify(pipeline, lambda: spark, since=rewound)  # the older copies stay accounted for
    assert since.ok and since.commits == 2, since.describe()  # the reset and the batch after it


def test_a_handed_over_topic_verifies_for_its_new_owner_and_a_table_partitioned_by_kafka_partition(
        broker, topic, make_pipeline, spark):
    from oncemore.ops.reset import reset

    produced = broker.produce(topic, orders(0, 60))
    first = make_pipeline(topic, sink={"partition_by": ["_kafka_partition"]})
    runner.run(first, spark_factory=lambda: spark)
    assert verify(first, lambda: spark).ok
    second = make_pipeline(topic, name="second", sink={"table_uri": first.sink.table_uri,
                                                       "quarantine_uri": first.sink.quarantine_uri,
                                                       "partition_by": ["_kafka_partition"]})
    reset(second, OffsetBound("latest"), take_over=True)
    produced += broker.produce(topic, orders(60, 30))
    runner.run(second, spark_factory=lambda: spark)

    report = verify(second, lambda: spark)

    assert report.ok, report.describe()
    assert (report.rows["main"], report.rows["before"]) == (30, 60), "the first owner's rows are not the second's"
    assert sorted(read_pairs(first.sink.table_uri)) == sorted(produced)


def test_a_table_on_s3_verifies_and_a_planted_duplicate_fails_it(broker, topic, make_pipeline, spark, s3_server, s3_bucket):
    produced = broker.produce(topic, orders(0, 600))
    pipeline = make_pipeline(topic, sink={"table_uri": f"{s3_bucket}/delta/orders",
                                          "quarantine_uri": f"{s3_bucket}/delta/orders_quarantine",
                                          "storage_options": s3_server.storage_options()})
    runner.run(pipeline, spark_factory=lambda: spark)
    report = verify(pipeline, lambda: spark)
    assert report.ok and report.rows["main"] == len(produced), report.describe()

    options = pipeline.sink.storage_options
    rows = DeltaTable(pipeline.sink.table_uri, storage_options=options).to_pyarrow_table()
    write_deltalake(pipeline.sink.table_uri, rows.slice(0, 1), mode="append", storage_options=options)
    failed = verify(pipeline, lambda: spark)
    assert failed.counts.get("duplicate") == 1 and not failed.ok


@pytest.mark.parametrize("format_version", [1, 2])
def test_a_table_of_an_early_commit_format_verifies_and_continues(broker, make_pipeline, spark, tmp_path, format_version):
    import shutil

    from oncemore.plan.commitinfo import FORMAT_VERSION

    topic = f"legacy{format_version}"
    broker.create_topic(topic, 2)
    records = [(i % 2, str(i).encode(), b"{not json" if i == 5 else json.dumps(
        {"id": i, "customer": f"c{i}", "amount": i * 1.5}).encode(), None) for i in range(26)]
    produced = broker.produce(topic, records)  # the first 16 as the fixture's run read them
    tables = tmp_path / "tables"
    shutil.copytree(ROOT / "tests" / "fixtures" / f"format{format_version}", tables)
    pipeline = make_pipeline(topic, name="legacy", sink={"table_uri": str(tables / "legacy"),
                                                         "quarantine_uri": str(tables / "legacy_quarantine")})
    assert {r.format_version for _, r in oncemore_commits(pipeline.sink.table_uri)} == {format_version}

    before = verify(pipeline, lambda: spark)
    assert before.ok and (before.commits, before.rows["main"], before.rows["quarantine"]) == (2, 15, 1), before.describe()

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 10 and {r.format_version for _, r in oncemore_commits(pipeline.sink.table_uri)} == {
        format_version, FORMAT_VERSION}
    after = verify(pipeline, lambda: spark)
    assert after.ok and (after.rows["main"], after.rows["quarantine"]) == (25, 1), after.describe()
    pairs = read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri)
    assert sorted(pairs) == sorted(produced)
