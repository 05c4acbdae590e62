"""End to end: real broker, Spark local[2], Delta tables on disk, read back by DuckDB.

Exactly-once is asserted by counting (partition, offset) pairs against the producer's own
delivery reports.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from conftest import (
    assert_exactly_once,
    held_positions,
    keyed,
    oncemore_commits,
    order,
    orders,
    query,
    read_pairs,
    run_with_fault,
)
from oncemore.commit import part
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import KafkaPartition, nested
from oncemore.core.stopwatch import RUN_PHASES, TASK_PHASES
from oncemore.kafka.clients import admin_client, log_bounds
from oncemore.plan.commitinfo import FORMAT_VERSION
from oncemore.plan.ledger import app_id, fingerprint
from oncemore.run import runner
from oncemore.run.runreport import RunReport

pytestmark = pytest.mark.spark


def no_spark():
    raise AssertionError("a no-op run must not start Spark")


def test_ingests_each_record_exactly_once_and_reruns_are_noops(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 21_000))
    pipeline = make_pipeline(topic)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.status == "committed"
    assert report.written == 21_000 and report.quarantined == 0
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    # Positions are the log end, read back from the txn actions.
    bounds = log_bounds(admin_client(pipeline), pipeline, keyed(topic, {0: 0, 1: 0, 2: 0}))
    positions = held_positions(pipeline.sink.table_uri, pipeline.name, topic)
    assert positions == {p.partition: bounds[p].latest for p in bounds}
    # The values survived: DuckDB sees the parsed columns.
    assert query(pipeline.sink.table_uri, "SELECT sum(id), count(DISTINCT customer) FROM {table}") == [(sum(range(21_000)), 97)]

    version = DeltaTable(pipeline.sink.table_uri).version()
    again = runner.run(pipeline, spark_factory=no_spark)
    assert again.status == "no-op" and again.plan.is_empty
    assert DeltaTable(pipeline.sink.table_uri).version() == version

    more = broker.produce(topic, orders(21_000, 3_000))
    third = runner.run(pipeline, spark_factory=lambda: spark)
    assert third.written == 3_000
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced + more)
    last = oncemore_commits(pipeline.sink.table_uri)[-1][1]
    assert last.records == {"written": 3_000, "quarantined": 0, "filtered": 0}
    assert {int(p): start for p, (start, _) in last.ranges[topic].items()} == positions


def test_commit_metadata_describes_the_batch(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    report = runner.run(pipeline, run_id="run-42", spark_factory=lambda: spark)

    (version, batch), = oncemore_commits(pipeline.sink.table_uri)
    assert [version] == report.batches[0].versions
    assert batch.pipeline == "orders" and batch.run_id == "run-42" and batch.until == "latest"
    assert batch.batch_seq == 0 and batch.format_version == FORMAT_VERSION and batch.oncemore_version
    bounds = {p.partition: b for p, b in log_bounds(admin_client(pipeline), pipeline, keyed(topic, {0: 0, 1: 0, 2: 0})).items()}
    assert batch.ranges == {topic: {str(p): [0, bounds[p].latest] for p in (0, 1, 2)}}
    assert batch.records == {"written": 300, "quarantined": 0, "filtered": 0}
    # The log end it planned to (here: all of it, so no lag) and how long the batch took.
    assert batch.log_end == {topic: {str(p): bounds[p].latest for p in (0, 1, 2)}} and batch.lag() == keyed(topic, {0: 0, 1: 0, 2: 0})
    assert batch.duration_ms > 0
    # The identity the offsets refer to, as the broker reports it.
    from confluent_kafka import TopicCollection

    (described,) = broker.admin().describe_topics(TopicCollection([topic])).values()
    assert batch.topic_ids == {topic: str(described.result().topic_id)} and batch.topic_ids[topic]
    assert batch.cluster_id == broker.admin().list_topics(timeout=10).cluster_id
    assert batch.bytes_read == sum(len(str(i)) + len(order(i)) for i in range(300))
    # txn actions carry lastUpdated, so Delta's transaction retention applies to them as written.
    log_entry = (Path(pipeline.sink.table_uri) / "_delta_log" / f"{version:020d}.json").read_text()
    txns = {json.loads(line)["txn"]["appId"]: json.loads(line)["txn"] for line in log_entry.splitlines() if '"txn"' in line}
    assert sorted(txns) == sorted([app_id("orders", topic, p) for p in (0, 1, 2)] + [
        f"oncemore/orders/{topic}/@topic_id", f"oncemore/orders/{topic}/@cluster_id", f"oncemore/@owner/{topic}"])
    assert all(t["lastUpdated"] > 1_700_000_000_000 for t in txns.values())
    # Beside the positions, what they refer to and whose they are: fingerprints of the IDs and of the pipeline.
    assert txns[f"oncemore/orders/{topic}/@topic_id"]["version"] == fingerprint(batch.topic_ids[topic])
    assert txns[f"oncemore/orders/{topic}/@cluster_id"]["version"] == fingerprint(batch.cluster_id)
    assert txns[f"oncemore/@owner/{topic}"]["version"] == fingerprint("orders")


def test_max_records_per_commit_splits_into_commits_each_with_its_positions(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 3_000))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 700})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert len(report.batches) >= 4
    commits = oncemore_commits(pipeline.sink.table_uri)
    assert [b.batch_seq for _, b in commits] == list(range(len(report.batches)))
    previous = {p: 0 for p in (0, 1, 2)}
    for version, batch in commits:
        ranges = {int(p): r for p, r in batch.ranges[topic].items()}
        assert sum(end - start for start, end in ranges.values()) <= 700
        snapshot = DeltaTable(pipeline.sink.table_uri, version=version)
        for partition, (start, end) in ranges.items():
            assert start == previous[partition], "batches must be contiguous"
            assert snapshot.transaction_version(app_id("orders", topic, partition)) == end
            previous[partition] = end
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    # What the run hands back (oncemore run --report-file, Airflow's lineage) is what the table holds.
    handed = RunReport.from_json(report.to_json(), report.plan)
    assert handed.committed == {KafkaPartition(topic, p): (0, end) for p, end in previous.items()}
    for batch, (version, record) in zip(handed.batches, commits):
        assert batch.versions == [version] and nested({k: list(v) for k, v in batch.committed.items()}) == record.ranges
    sizes = DeltaTable(pipeline.sink.table_uri).get_add_actions(flatten=True).column("size_bytes").to_pylist()
    assert handed.added == {"main": {"rows": query(pipeline.sink.table_uri, "SELECT count(*) FROM {table}")[0][0],
                                     "bytes": sum(sizes), "files": len(sizes)}}
    assert handed.committed_versions == {"main": DeltaTable(pipeline.sink.table_uri).version(), "quarantine": None}
    # Each commit says where its time went; the run's own phases only in the run's first commit.
    profiles = [b.profile for _, b in commits]
    assert set(RUN_PHASES) <= set(profiles[0]) and not set(RUN_PHASES) & set(profiles[1])
    for (_, batch), profile in zip(commits, profiles):
        assert {"spark_job", "read", "decode", "write", "validate"} <= set(profile), profile
        assert profile["read"] > 0 and profile["write"] > 0 and profile["spark_job"] <= batch.duration_ms
    # The run's profile is its parts' plus its own, each phase counted once.
    assert abs(report.profile["spark_job"] - sum(p["spark_job"] for p in profiles)) <= len(profiles)
    assert report.profile["commit"] > 0 and sum(report.profile.values()) <= report.seconds * 1000 + sum(
        report.profile[p] for p in TASK_PHASES)


def test_malformed_records_go_to_quarantine_and_counts_add_up(broker, topic, make_pipeline, spark):
    records = orders(0, 2_000)
    bad_values = {7: b"not json", 100: b'{"id": "seven"}', 555: b"", 1_001: b'{"id": 1} {"id": 2}'}
    for index, value in bad_values.items():
        partition, key, _, stamp = records[index]
        records[index] = (partition, key, value, stamp)
    produced = broker.produce(topic, records)
    bad_pairs = [produced_pair for produced_pair, record in zip(_delivery_order(produced, records), records)
                 if record[2] in bad_values.values()]
    pipeline = make_pipeline(topic)

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 2_000 - 4 and report.quarantined == 4
    main_pairs = read_pairs(pipeline.sink.table_uri)
    quarantine_pairs = read_pairs(pipeline.sink.quarantine_uri)
    assert set(quarantine_pairs) == set(bad_pairs)
    assert not set(main_pairs) & set(quarantine_pairs)
    assert_exactly_once(main_pairs + quarantine_pairs, produced)
    quarantined = query(pipeline.sink.quarantine_uri, "SELECT value, error FROM {table}")
    assert sorted(v for v, _ in quarantined) == sorted(bad_values.values())
    assert all(error for _, error in quarantined)
    # The quarantine commit carries the same ledger for the same app ids.
    (version, batch), = oncemore_commits(pipeline.sink.quarantine_uri)
    assert batch.records["quarantined"] == 4
    sizes = DeltaTable(pipeline.sink.quarantine_uri).get_add_actions(flatten=True).column("size_bytes").to_pylist()
    assert report.added["quarantine"] == {"rows": len(quarantined), "bytes": sum(sizes), "files": len(sizes)}
    assert report.committed_versions["quarantine"] == version


def _delivery_order(produced: list[tuple[int, int]], records) -> list[tuple[int, int]]:
    """The (partition, offset) of each record in produce order (offsets grow per partition)."""
    by_partition: dict[int, list[int]] = {}
    for partition, offset in produced:
        by_partition.setdefault(partition, []).append(offset)
    cursors = {p: iter(sorted(offsets)) for p, offsets in by_partition.items()}
    return [(r[0], next(cursors[r[0]])) for r in records]


def test_crash_after_writing_files_before_commit_then_rerun_is_exactly_once(broker, topic, make_pipeline, spark, monkeypatch):
    produced = broker.produce(topic, orders(0, 1_500))
    pipeline = make_pipeline(topic)

    def crash(*args, **kwargs):
        raise SystemExit("injected crash between writing files and committing")

    monkeypatch.setattr(part, "commit", crash)
    with pytest.raises(SystemExit):
        runner.run(pipeline, spark_factory=lambda: spark)
    monkeypatch.undo()

    table_dir = Path(pipeline.sink.table_uri)
    orphans = {p.name for p in table_dir.glob("*.parquet")}
    assert orphans, "the crashed run wrote files"
    assert read_pairs(pipeline.sink.table_uri) == [], "nothing is visible without a commit"

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    referenced = {Path(uri).name for uri in DeltaTable(pipeline.sink.table_uri).file_uris()}
    assert referenced and not referenced & orphans
    vacuumed = DeltaTable(pipeline.sink.table_uri).vacuum(retention_hours=0, enforce_retention_duration=False,
                                                           dry_run=False, full=True)
    assert {Path(p).name for p in vacuumed} == orphans
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_crash_between_quarantine_and_main_commit_heals_on_rerun(broker, topic, make_pipeline, spark,
                                                                  crash_before_main_commit):
    records = orders(0, 900)
    records[10] = (records[10][0], records[10][1], b"{broken", None)
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)
    crash_before_main_commit(pipeline, spark)
    assert len(read_pairs(pipeline.sink.quarantine_uri)) == 1
    assert read_pairs(pipeline.sink.table_uri) == []
    quarantine_version = DeltaTable(pipeline.sink.quarantine_uri).version()

    report = runner.run(pipeline, spark_factory=lambda: spark)

    # The record is counted as the range's quarantined record; the quarantine table already held it.
    assert report.quarantined == 1 and report.batches[0].quarantine_versions == []
    assert DeltaTable(pipeline.sink.quarantine_uri).version() == quarantine_version
    main_pairs, quarantine_pairs = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert len(quarantine_pairs) == 1
    assert_exactly_once(main_pairs + quarantine_pairs, produced)


def test_two_processes_racing_for_the_same_range_commit_once(broker, topic, make_pipeline, tmp_path):
    produced = broker.produce(topic, orders(0, 3_000))
    pipeline = make_pipeline(topic)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "include"),
           "ONCEMORE_SPARK_MASTER": "local[1]"}
    command = [sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin]
    racers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    results = [(r.wait(timeout=600), r.stdout.read(), r.stderr.read()) for r in racers]

    for code, out, err in results:
        assert code == 0, err[-2000:]
    assert sorted("no-op" in out for _, out, _ in results) == [False, True], [out for _, out, _ in results]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert len(oncemore_commits(pipeline.sink.table_uri)) == 1


def _commit_racer(table_uri, storage_options, topic, start, end, barrier, results):
    """Runs in a spawned process: writes its own file for offsets [start, end), then commits at the barrier."""
    import pyarrow as pa

    from oncemore.commit.committer import commit
    from oncemore.core.columns import QUARANTINE_SCHEMA
    from oncemore.core.coordinates import KafkaPartition
    from oncemore.plan.commitinfo import CommitInfo
    from oncemore.plan.ledger import Ledger
    from oncemore.write.files import TableWriter

    rows = end - start
    table = pa.table({
        "key": pa.array([None] * rows, pa.binary()), "value": pa.array([b"x"] * rows, pa.binary()),
        "error": ["e"] * rows, "_kafka_topic": [topic] * rows, "_kafka_partition": pa.array([0] * rows, pa.int32()),
        "_kafka_offset": pa.array(range(start, end), pa.int64()),
        "_kafka_timestamp": pa.array([None] * rows, pa.timestamp("us", tz="UTC")),
    }).cast(QUARANTINE_SCHEMA)
    writer = TableWriter("main", table_uri, QUARANTINE_SCHEMA, (), storage_options)
    writer.write(table)
    files = writer.close()
    record = CommitInfo(pipeline="racers", run_id=f"racer-{os.getpid()}", ranges={topic: {"0": [start, end]}},
                          records={"written": rows, "quarantined": 0, "filtered": 0})
    ledger = Ledger(table_uri, "racers", storage_options)
    barrier.wait(timeout=60)
    key = KafkaPartition(topic, 0)
    results.put(commit(ledger, files, {key: start or None}, {key: end}, [key], record).status)


@pytest.mark.parametrize("store", ["local disk", "S3"])
def test_concurrent_commits_of_the_same_batch_have_exactly_one_winner(tmp_path, store, request):
    from oncemore.commit.tables import ensure_table
    from oncemore.core.columns import QUARANTINE_SCHEMA

    if store == "S3":  # delta-rs's conditional put (ETag) on a real S3 API
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        table_uri, options = f"{bucket}/race", {**server.storage_options(), "conditional_put": "etag"}
    else:
        table_uri, options = str(tmp_path / "race"), {}
    ensure_table(table_uri, QUARANTINE_SCHEMA, (), "race", "commit race", options)
    context = multiprocessing.get_context("spawn")  # fork hangs after deltalake was used (PLATFORM.md)
    statuses = []
    for round_ in range(3):  # three ranges, each raced for by three processes
        barrier, results = context.Barrier(3), context.Queue()
        racers = [context.Process(target=_commit_racer, args=(table_uri, options, "t", 500 * round_, 500 * (round_ + 1), barrier, results))
                  for _ in range(3)]
        for racer in racers:
            racer.start()
        for racer in racers:
            racer.join(120)
            assert racer.exitcode == 0
        statuses.append(sorted(results.get(timeout=5) for _ in racers))

    for raced in statuses:
        assert raced.count("committed") == 1, statuses
        assert set(raced) - {"committed"} <= {"already_committed", "lost_race"}
    table = DeltaTable(table_uri, storage_options=options)
    assert table.version() == 3, "table creation and one commit per range: none lost, none doubled"
    local = server.download(table_uri, tmp_path / "copy") if store == "S3" else Path(table_uri)
    assert_exactly_once(read_pairs(str(local)), [(0, o) for o in range(1_500)])
    assert table.transaction_version(app_id("racers", "t", 0)) == 1_500


def test_aborted_transactions_never_land(broker, topic, make_pipeline, spark):
    committed = broker.produce(topic, orders(0, 300), transactional_id="writer")
    broker.produce(topic, orders(300, 300), transactional_id="writer", abort=True)
    committed += broker.produce(topic, orders(600, 300), transactional_id="writer")
    pipeline = make_pipeline(topic)

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(read_pairs(pipeline.sink.table_uri), committed)


def test_raw_format_keeps_key_and_value_bytes(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, [(0, b"k1", b"\x00\xffbinary", None), (1, None, None, None), (2, b"k3", b"{}", None)])
    pipeline = make_pipeline(topic, format={"type": "raw"})

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert query(pipeline.sink.table_uri, "SELECT key, value FROM {table} ORDER BY ALL") == sorted(
        [(b"k1", b"\x00\xffbinary"), (None, None), (b"k3", b"{}")], key=lambda r: (r[0] is None, r)
    )


def test_partition_by_writes_hive_directories_and_stats(broker, topic, make_pipeline, spark):
    # The longest value a directory name holds (255 bytes with "region="), and two that pass it.
    longest, accented, slashes = "a" * 248, "é" * 130, "/" * 86
    regions = ["eu", "us west", None, "", longest, accented, slashes]
    records = [(i % 3, None, json.dumps({"id": i, "region": regions[i % 7]}).encode(), None) for i in range(700)]
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT, region STRING"},
                             sink={"partition_by": ["region"]})
    runner.run(pipeline, spark_factory=lambda: spark)

    # An empty string would read back as NULL (Delta's partition values), a value whose directory
    # name a file system cannot hold would fail every write of it: quarantined, not changed.
    main, quarantined = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert_exactly_once(main + quarantined, produced)
    assert len(quarantined) == 300
    assert query(pipeline.sink.quarantine_uri, "SELECT error, count(*) FROM {table} GROUP BY error ORDER BY ALL") == [
        ("column 'region' partitions the table and Delta reads an empty partition value as NULL: the row would "
         "not read back as sent", 100),
        ("column 'region' partitions the table and this value makes a directory name of 265 bytes, more than the "
         "255 a file or object store's name may hold", 100),
        ("column 'region' partitions the table and this value makes a directory name of 267 bytes, more than the "
         "255 a file or object store's name may hold", 100)]
    assert query(pipeline.sink.table_uri, "SELECT region, count(*) FROM {table} GROUP BY region ORDER BY ALL") == [
        (longest, 100), ("eu", 100), ("us west", 100), (None, 100)]
    actions = pa.table(DeltaTable(pipeline.sink.table_uri).get_add_actions(flatten=True)).to_pylist()
    assert {a["partition.region"] for a in actions} == {"eu", "us west", longest, None}
    # Directories are named as Spark names them; the log holds their URI form.
    assert {a["path"].split("/")[0] for a in actions} == {
        "region=eu", "region=us%20west", f"region={longest}", "region=__HIVE_DEFAULT_PARTITION__"}
    assert {d.name for d in Path(pipeline.sink.table_uri).glob("region=*")} == {
        "region=eu", "region=us west", f"region={longest}", "region=__HIVE_DEFAULT_PARTITION__"}
    assert sum(a["num_records"] for a in actions) == 400
    assert min(a["min.id"] for a in actions) == 0 and max(a["max.id"] for a in actions) == 697  # 698 and 699 are too long


def test_starting_latest_skips_the_backlog_and_records_every_partition(broker, topic, make_pipeline, spark):
    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, source={"starting_offsets": "latest"})

    def spark_never():
        raise AssertionError("a run with nothing to read started Spark")

    first = runner.run(pipeline, spark_factory=spark_never)
    assert first.written == 0 and first.status == "committed", "the start is recorded even with nothing to read"
    new = broker.produce(topic, orders(300, 90))
    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(read_pairs(pipeline.sink.table_uri), new)


def test_partitions_added_later_start_at_earliest(broker, topic, make_pipeline, spark):
    pipeline = make_pipeline(topic, source={"starting_offsets": "latest"})
    broker.produce(topic, orders(0, 30))
    runner.run(pipeline, spark_factory=lambda: spark)
    broker.add_partitions(topic, 4)
    added = broker.produce(topic, [(3, None, order(i), None) for i in range(20)])

    runner.run(pipeline, spark_factory=lambda: spark)

    assert_exactly_once(read_pairs(pipeline.sink.table_uri), added)


def test_until_timestamp_ingests_records_before_it(broker, topic, make_pipeline, spark):
    hour = 3_600_000
    base = 1_790_000_000_000
    records = [(i % 3, None, order(i), base + (i // 30) * hour) for i in range(90)]  # 3 hours, 30 records each
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)

    report = runner.run(pipeline, until=OffsetBound(kind="timestamp", timestamp_ms=base + 2 * hour),
                        spark_factory=lambda: spark)

    assert report.written == 60
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), _delivery_order(produced, records)[:60])


def test_concurrent_runs_of_consecutive_intervals_neither_fail_nor_duplicate(broker, topic, make_pipeline):
    produced = broker.produce(topic, orders(0, 3_000))
    pipeline = make_pipeline(topic)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "include"),
           "ONCEMORE_SPARK_MASTER": "local[1]"}
    # Like two interval runs with max_active_runs > 1: both plan from the same positions, to different ends.
    runs = [subprocess.Popen([sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin, "--until",
                              json.dumps({str(p): end for p in range(3)})],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for end in (500, 1_000)]
    results = [(r.wait(timeout=600), r.stdout.read(), r.stderr.read()) for r in runs]

    for code, _, err in results:
        assert code == 0, err[-2000:]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert DeltaTable(pipeline.sink.table_uri).transaction_version(app_id("orders", topic, 0)) == 1_000


def test_quarantine_rows_are_kept_when_runs_to_different_ends_race(broker, topic, make_pipeline, spark, monkeypatch):
    # Every third value malformed, so both runs' ranges hold quarantine rows in every partition.
    records = [(p, k, b"{broken" if (i // 3) % 3 == 0 else v, t) for i, (p, k, v, t) in enumerate(orders(0, 300))]
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic)
    real_commit = part.commit
    b_arrived, a_quarantine_done, b_second_done = (threading.Event() for _ in range(3))
    calls = {"run-a": 0, "run-b": 0}

    def scheduled(ledger, files, expected, new_positions, partitions, record):
        # A (to 40) commits its quarantine part while B (to 80) holds files read from the same start;
        # B's next commit follows, and A's main commit comes only after that.
        n = calls[record.run_id]
        calls[record.run_id] += 1
        if record.run_id == "run-b" and n == 0:
            b_arrived.set()
            assert a_quarantine_done.wait(300)
        if record.run_id == "run-a" and n == 0:
            assert b_arrived.wait(300)
        if record.run_id == "run-a" and ledger.table_uri == pipeline.sink.table_uri:
            assert b_second_done.wait(300)
        try:
            return real_commit(ledger, files, expected, new_positions, partitions, record)
        finally:
            if record.run_id == "run-a" and n == 0:
                a_quarantine_done.set()
            if record.run_id == "run-b" and n == 1:
                b_second_done.set()

    monkeypatch.setattr(part, "commit", scheduled)
    results = {}

    def run(run_id, end):
        until = OffsetBound.parse(json.dumps({str(p): end for p in range(3)}))
        try:
            results[run_id] = runner.run(pipeline, until=until, run_id=run_id, spark_factory=lambda: spark)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[run_id] = exc

    threads = [threading.Thread(target=run, args=args) for args in (("run-a", 40), ("run-b", 80))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert all(isinstance(r, RunReport) for r in results.values()), results
    main, quarantined = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    expected = [pair for pair in produced if pair[1] < 80]
    assert_exactly_once(main + quarantined, expected)
    assert calls["run-b"] > 2, "B's quarantine commit lost the race and B went round, as intended"
    bad = {pair for pair, record in zip(_delivery_order(produced, records), records) if record[2] == b"{broken"}
    assert set(quarantined) == {pair for pair in bad if pair[1] < 80}
    held = held_positions(pipeline.sink.table_uri, "orders", topic)
    assert held == held_positions(pipeline.sink.quarantine_uri, "orders", topic) == {0: 80, 1: 80, 2: 80}


def test_json_null_and_invalid_utf8_go_to_quarantine_and_the_run_goes_on(broker, topic, make_pipeline, spark):
    # null opening partition 0's range, null after a malformed record (a bisected group) in
    # partition 1, null beside a NOT NULL column; invalid UTF-8 as the largest string of a column.
    values = {0: [b"null", order(1), b"[]", order(2)],
              1: [order(3), b"{oops", b"null", order(4), b"true"],
              2: [order(5), b'{"id": 6, "customer": "\xff\xfe"}', b'{"id": 7, "customer": "caf\xc3\xa9"}', b'"x"']}
    records = [(p, None, v, None) for p, vs in values.items() for v in vs]
    produced = broker.produce(topic, records)
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT NOT NULL, customer STRING"})

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.written == 6 and report.quarantined == 7
    main, quarantined = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert_exactly_once(main + quarantined, produced)
    errors = dict(query(pipeline.sink.quarantine_uri, "SELECT _kafka_partition * 100 + _kafka_offset, error FROM {table}"))
    assert errors[0] == errors[102] == "value is JSON null, not a JSON object"
    assert "'}'" in errors[101] and "not valid UTF-8" in errors[201]
    assert query(pipeline.sink.table_uri, "SELECT min(customer), max(customer) FROM {table}") == [("café", "customer-5")]
    assert runner.run(pipeline, spark_factory=no_spark).status == "no-op"


def test_a_crashed_python_worker_fails_the_run_naming_topic_partitions_and_offsets(broker, topic, make_pipeline):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    done = run_with_fault(pipeline, "task")

    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"oncemore: error: pipeline orders: the Spark task reading {topic}/0 [0, 10), "
                           f"{topic}/1 [0, 10), {topic}/2 [0, 10) failed: "), last
    assert "Python worker exited unexpectedly" in last
    assert read_pairs(pipeline.sink.table_uri) == []


def test_a_record_read_but_in_no_file_is_refused_without_a_transform(broker, topic, make_pipeline, spark, monkeypatch):
    # Without a transform nothing may filter: a record the tasks' files lost would otherwise be
    # booked as filtered and committed past.
    from dataclasses import replace

    from oncemore.core.errors import InvalidDataFile

    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    real_job = runner.ingest_job

    def one_more_read_than_written(*args, **kwargs):
        results = real_job(*args, **kwargs)
        return [replace(results[0], records=results[0].records + 1), *results[1:]]

    monkeypatch.setattr(runner, "ingest_job", one_more_read_than_written)
    with pytest.raises(InvalidDataFile, match=rf"pipeline orders: {topic}/\d \[0, 10\): 11 records read, only 10 rows "
                                              r"written and 0 quarantined, and no transform filters"):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert read_pairs(pipeline.sink.table_uri) == []


def test_a_part_whose_commits_move_no_position_fails_the_run_instead_of_going_round(
        broker, topic, make_pipeline, spark, monkeypatch):
    # A part whose commits move neither table's positions (nothing of it landed, no other run's
    # either) would be planned again, the same, forever.
    from oncemore.commit.part import PartOutcome
    from oncemore.core.errors import CommitConflict

    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    parts = []

    def commits_nothing(part, results, *args, **kwargs):
        parts.append(part.starts)
        if len(parts) > 1:
            raise AssertionError(f"the same part planned again: {parts}")
        return PartOutcome("conflict", None, None, {}, {}, 0, None)

    monkeypatch.setattr(runner, "commit_part", commits_nothing)
    with pytest.raises(CommitConflict, match=r"^pipeline orders: batch 0 made no progress from "):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert read_pairs(pipeline.sink.table_uri) == []


def test_a_table_location_that_cannot_take_a_table_fails_naming_pipeline_and_key_and_creates_neither(
        broker, topic, make_pipeline, tmp_path):
    from oncemore.core.errors import TableLocationError

    broker.produce(topic, orders(0, 30))
    (tmp_path / "a-file").write_text("not a directory")
    for key in ("table_uri", "quarantine_uri"):
        pipeline = make_pipeline(topic, name=f"bad_{key.split('_')[0]}", sink={key: str(tmp_path / "a-file" / "t")})
        with pytest.raises(TableLocationError, match=rf"^pipeline bad_\w+: sink\.{key} {tmp_path}/a-file/t: no table can "
                                                     rf"be created there: {tmp_path}/a-file is a file, not a directory; "
                                                     "nothing was created$"):
            runner.run(pipeline, spark_factory=no_spark)
        other = pipeline.sink.quarantine_uri if key == "table_uri" else pipeline.sink.table_uri
        assert not Path(other).exists(), "the other table was created"
