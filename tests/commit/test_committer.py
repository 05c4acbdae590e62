"""The driver-side guards: position checks before a commit, validation of added files, which task
results a commit may take when byte budgets cut tasks short, and tables oncemore cannot write."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, TableFeatures
from deltalake.exceptions import CommitFailedError

from conftest import keyed, orders, read_pairs
from oncemore.commit.committer import already_committed, commit, commit_positions, covered_prefix, validate_files
from oncemore.commit.groupmirror import GroupMirror
from oncemore.commit.inputs import RangeResult
from oncemore.commit.tables import ensure_table, ensure_tables
from oncemore.core.columns import QUARANTINE_SCHEMA
from oncemore.core.errors import CommitConflict, InvalidDataFile, UnsupportedTable
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.run import runner
from oncemore.write.files import TableWriter


def test_positions_at_the_batch_start_commit_past_its_end_are_done_anything_else_conflicts():
    ledger, k = Ledger("t", "p"), lambda values: keyed("orders", values)
    assert already_committed(ledger, k({0: 10, 1: None}), k({0: 10, 1: None}), k({0: 20, 1: 5})) is False
    assert already_committed(ledger, k({0: 20, 1: 9}), k({0: 10, 1: None}), k({0: 20, 1: 5})) is True
    with pytest.raises(CommitConflict, match=r"orders/0: expected 10, found 15, batch ends at 20"):
        already_committed(ledger, k({0: 15, 1: None}), k({0: 10, 1: None}), k({0: 20, 1: 5}))


def result(partition, start, end, reached):
    return RangeResult("orders", partition, start, end, reached, 0, reached - start, 0, ())


def test_a_commit_takes_each_partition_up_to_the_first_task_cut_short_and_drops_what_follows():
    results = [result(0, 0, 100, 100), result(0, 100, 200, 150), result(0, 200, 300, 300),
               result(1, 5, 50, 50), result(2, 0, 10, 10)]
    ends, kept, dropped = covered_prefix(reversed(results), keyed("orders", {0: 0, 1: 5, 2: 0, 3: 7}))
    assert ends == keyed("orders", {0: 150, 1: 50, 2: 10, 3: 7})
    assert sorted((r.partition, r.start) for r in kept) == [(0, 0), (0, 100), (1, 5), (2, 0)]
    assert [(r.partition, r.start) for r in dropped] == [(0, 200)]


def rows(offsets) -> pa.Table:
    n = len(offsets)
    return pa.table({
        "key": pa.array([None] * n, pa.binary()), "value": pa.array([b"v"] * n, pa.binary()), "error": ["e"] * n,
        "_kafka_topic": ["orders"] * n, "_kafka_partition": pa.array([1] * n, pa.int32()),
        "_kafka_offset": pa.array(offsets, pa.int64()), "_kafka_timestamp": pa.array([None] * n, pa.timestamp("us", tz="UTC")),
    }).cast(QUARANTINE_SCHEMA)


def written(tmp_path, offsets):
    writer = TableWriter("quarantine", str(tmp_path), QUARANTINE_SCHEMA)
    writer.write(rows(offsets))
    return writer.close()


def test_valid_files_pass_and_report_their_offsets(tmp_path):
    (data_file,) = written(tmp_path, [5, 6, 9])
    assert (data_file.offsets, data_file.num_records) == ({"orders/1": [5, 9, 3]}, 3)
    validate_files(str(tmp_path), [data_file], QUARANTINE_SCHEMA, (), keyed("orders", {1: (5, 10)}))


def test_files_outside_the_range_missing_or_with_another_schema_are_refused(tmp_path):
    (data_file,) = written(tmp_path, [5, 6, 10])
    with pytest.raises(InvalidDataFile, match=r"offsets \[5, 10\] of orders/1 fall outside the batch range \[5, 10\)"):
        validate_files(str(tmp_path), [data_file], QUARANTINE_SCHEMA, (), keyed("orders", {1: (5, 10)}))
    other_schema = pa.schema([f for f in QUARANTINE_SCHEMA if f.name != "error"])
    with pytest.raises(InvalidDataFile, match="differs from the table's"):
        validate_files(str(tmp_path), [data_file], other_schema, (), keyed("orders", {1: (0, 100)}))
    (tmp_path / data_file.path).unlink()
    with pytest.raises(InvalidDataFile, match="missing"):
        validate_files(str(tmp_path), [data_file], QUARANTINE_SCHEMA, (), keyed("orders", {1: (0, 100)}))


@pytest.mark.parametrize("change, named", [
    (lambda table: table.alter.add_constraint({"positive_amount": "amount > 0"}), "CHECK constraint positive_amount (amount > 0)"),
    (lambda table: table.alter.add_feature(TableFeatures.RowTracking, allow_protocol_versions_increase=True),
     "writer feature rowTracking"),
])
def test_a_table_asking_writers_for_what_oncemore_does_not_do_is_refused_before_writing(
        broker, topic, make_pipeline, spark, change, named):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    table = DeltaTable.create(pipeline.sink.table_uri, pipeline.static_columns(pipeline.main))
    change(table)
    version = DeltaTable(pipeline.sink.table_uri).version()

    with pytest.raises(UnsupportedTable, match=re.escape(named)):
        runner.run(pipeline, spark_factory=lambda: spark)

    assert DeltaTable(pipeline.sink.table_uri).version() == version
    assert not list(Path(pipeline.sink.table_uri).glob("*.parquet")), "nothing was written"


def race_table(tmp_path) -> Ledger:
    ensure_table(str(tmp_path / "t"), QUARANTINE_SCHEMA, (), "t", "commit lookups")
    return Ledger(str(tmp_path / "t"), "p")


def test_our_commit_is_found_past_twenty_foreign_commits_and_its_files_kept(tmp_path, monkeypatch):
    ledger = race_table(tmp_path)
    files = written(tmp_path / "t", [0, 1, 2])
    real = DeltaTable.create_write_transaction
    foreign = Ledger(ledger.table_uri, "other")

    def then_foreign_commits(table, *args, **kwargs):
        real(table, *args, **kwargs)
        monkeypatch.setattr(DeltaTable, "create_write_transaction", real)
        for n in range(25):  # other writers land before our lookup
            commit_positions(foreign, keyed("other-topic", {0: n + 1}), CommitInfo(pipeline="other", run_id=f"other-{n}"))

    monkeypatch.setattr(DeltaTable, "create_write_transaction", then_foreign_commits)
    record = CommitInfo(pipeline="p", run_id="ours", ranges={"orders": {"1": [0, 3]}})

    outcome = commit(ledger, files, keyed("orders", {1: None}), keyed("orders", {1: 3}), keyed("orders", {1: 0}), record)

    assert (outcome.status, outcome.version) == ("committed", 1)
    assert DeltaTable(ledger.table_uri).version() == 26
    assert all((tmp_path / "t" / f.path).exists() for f in files), "committed files are never deleted"
    assert read_pairs(ledger.table_uri) == [(1, 0), (1, 1), (1, 2)]


def test_the_tables_oncemore_creates_are_checkpointed_every_ten_commits(tmp_path):
    # Every txn lookup replays the commits since the last checkpoint: the tail stays under ten.
    ledger = race_table(tmp_path)
    for n in range(25):
        commit_positions(ledger, keyed("orders", {0: n + 1}), CommitInfo(pipeline="p", run_id=f"run-{n}"))
    log = Path(ledger.table_uri, "_delta_log")
    assert sorted(int(f.name[:20]) for f in log.glob("*.checkpoint.parquet")) == [9, 19]
    assert Ledger(ledger.table_uri, "p").positions(keyed("orders", {0: None})) == keyed("orders", {0: 25})


def test_our_commit_is_found_when_commits_land_between_the_snapshot_and_the_lookup(tmp_path, monkeypatch):
    # Maintenance or another run committing while we look our commit up: delta-rs's history()
    # labels the newest commits on storage from the snapshot's version, shifting every label.
    ledger = race_table(tmp_path)
    files = written(tmp_path / "t", [0, 1, 2])
    real_commit, real_update = DeltaTable.create_write_transaction, DeltaTable.update_incremental
    foreign, state = Ledger(ledger.table_uri, "other"), {"committed": False, "landing": False}

    def committed(table, *args, **kwargs):
        real_commit(table, *args, **kwargs)
        state["committed"] = True

    def then_foreign_commits(table):
        real_update(table)
        if state["committed"] and not state["landing"]:
            state["landing"] = True  # once, and not for the foreign ledger's own updates
            for n in range(3):
                commit_positions(foreign, keyed("other-topic", {0: n + 1}), CommitInfo(pipeline="other", run_id=f"other-{n}"))

    monkeypatch.setattr(DeltaTable, "create_write_transaction", committed)
    monkeypatch.setattr(DeltaTable, "update_incremental", then_foreign_commits)
    record = CommitInfo(pipeline="p", run_id="ours", ranges={"orders": {"1": [0, 3]}})

    outcome = commit(ledger, files, keyed("orders", {1: None}), keyed("orders", {1: 3}), keyed("orders", {1: 0}), record)

    assert (outcome.status, outcome.version) == ("committed", 1)
    assert DeltaTable(ledger.table_uri).version() == 4
    # Every version the ledger reports holds the commit it names, snapshot behind storage or not.
    stale = DeltaTable(ledger.table_uri, version=2)
    assert [(e.version, e.record.run_id) for e in Ledger(ledger.table_uri, "p").recent_commits(10, stale)] == [
        (2, "other-0"), (1, "ours")]


def test_a_commit_that_landed_before_delta_rs_retried_it_is_ours_not_a_lost_race(tmp_path, monkeypatch):
    ledger = race_table(tmp_path)
    files = written(tmp_path / "t", [0, 1, 2])
    real = DeltaTable.create_write_transaction

    def landed_then_conflicted(table, *args, **kwargs):
        # The first attempt landed, its response was lost, and delta-rs's own retry conflicted with it.
        real(table, *args, **kwargs)
        raise CommitFailedError("Transaction failed: Concurrent transaction failed.")

    monkeypatch.setattr(DeltaTable, "create_write_transaction", landed_then_conflicted)
    record = CommitInfo(pipeline="p", run_id="ours", ranges={"orders": {"1": [0, 3]}})

    outcome = commit(ledger, files, keyed("orders", {1: None}), keyed("orders", {1: 3}), keyed("orders", {1: 0}), record)

    assert (outcome.status, outcome.version) == ("committed", 1)
    assert ledger.positions(keyed("orders", {1: 0})) == keyed("orders", {1: 3})


def test_a_landed_commit_whose_retry_conflicted_still_mirrors_positions(broker, topic, make_pipeline, spark, monkeypatch):
    produced = broker.produce(topic, orders(0, 60))
    pipeline = make_pipeline(topic, commit_consumer_group=True)
    real = DeltaTable.create_write_transaction

    def landed_then_conflicted(table, *args, **kwargs):
        real(table, *args, **kwargs)
        raise CommitFailedError("Transaction failed: Concurrent transaction failed.")

    monkeypatch.setattr(DeltaTable, "create_write_transaction", landed_then_conflicted)
    mirrored = []
    monkeypatch.setattr(GroupMirror, "mirror", lambda self, positions, version: mirrored.append((positions, version)))

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.status == "committed" and report.written == 60
    assert mirrored == [(keyed(topic, {0: 20, 1: 20, 2: 20}), report.batches[0].versions[0])]
    assert read_pairs(pipeline.sink.table_uri) == sorted(produced)


@pytest.mark.parametrize("change, named", [
    (lambda table: table.alter.add_feature(TableFeatures.RowTracking, allow_protocol_versions_increase=True),
     "row tracking (writer feature rowTracking)"),
    # delta-rs commits add actions without evaluating a constraint: its rows would land in breach.
    (lambda table: table.alter.add_constraint({"known_offset": "_kafka_offset < 2"}), "CHECK constraint known_offset"),
])
def test_a_table_changed_after_the_run_checked_it_refuses_the_commit_as_unsupported(tmp_path, change, named):
    ledger = race_table(tmp_path)
    files = written(tmp_path / "t", [0, 1, 2])
    change(DeltaTable(ledger.table_uri))  # another writer, between the run's check of the table and its commit
    version = DeltaTable(ledger.table_uri).version()
    record = CommitInfo(pipeline="p", run_id="ours", ranges={"orders": {"1": [0, 3]}})

    with pytest.raises(UnsupportedTable, match=re.escape(named)):
        commit(ledger, files, keyed("orders", {1: None}), keyed("orders", {1: 3}), keyed("orders", {1: 0}), record)
    assert DeltaTable(ledger.table_uri).version() == version


def test_a_feature_delta_rs_cannot_write_refuses_a_reset_as_unsupported_not_as_a_conflict(tmp_path):
    ledger = race_table(tmp_path)
    DeltaTable(ledger.table_uri).alter.add_feature(TableFeatures.RowTracking, allow_protocol_versions_increase=True)
    with pytest.raises(UnsupportedTable, match=re.escape(f"table {ledger.table_uri}: Unsupported table features "
                                                         "required: [RowTracking]; nothing was committed")):
        commit_positions(ledger, keyed("orders", {1: 5}), CommitInfo(pipeline="p", run_id="reset"))


def test_a_quarantine_table_asking_for_what_oncemore_does_not_do_is_refused_before_either_table_changes(
        topic, make_pipeline):
    pipeline = make_pipeline(topic)
    DeltaTable.create(pipeline.sink.quarantine_uri, QUARANTINE_SCHEMA).alter.add_feature(
        TableFeatures.RowTracking, allow_protocol_versions_increase=True)  # writer version 7, no invariants listed

    with pytest.raises(UnsupportedTable, match=re.escape(f"table {pipeline.sink.quarantine_uri} asks its writers for "
                                                         "what oncemore does not do: row tracking")):
        ensure_tables(pipeline, {"main": pipeline.static_columns(pipeline.main)})
    assert DeltaTable(pipeline.sink.quarantine_uri).version() == 1
    assert not Path(pipeline.sink.table_uri).exists()
