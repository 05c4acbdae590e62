"""An upsert table audited and shown: ``oncemore verify`` checks one row per key, rows inside
committed ranges and each commit's record accounting for its records; ``--replay`` reads the
committed ranges again and names a row another tool changed, holds a late event stale against
the rows of commits the log no longer keeps and the deletes the tombstones table holds, compares
a row with the schema its commit wrote, and refuses by name what Kafka no longer holds;
``status`` and the oncemore page show each batch's inserted, updated, deleted and stale;
``maintain`` forgets tombstones past their retention in the stream's time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource
from deltalake import DeltaTable, write_deltalake

from conftest import ROOT, oncemore, oncemore_commits
from devtools.changefeed import ChangeEvent, debezium_events, fold, produce, read_back, table_state
from oncemore.commit.merge import COUNTS
from oncemore.config.values import ConfigError
from oncemore.core.columns import tombstones_schema
from oncemore.report.history import Piece
from oncemore.report.replay import Replayable, ReplayImpossible, replayable
from oncemore.report.verify import verify
from oncemore.run.runner import run

pytestmark = pytest.mark.spark

ROW = "id BIGINT, name STRING, balance BIGINT"
SHOWN = ("inserted", "updated", "deleted", "stale")  # per batch, in status and on the page


def debezium(make_pipeline, topic, sequence_by=None, merge="local", **overrides):
    upsert = {"keys": ["id"], "envelope": "debezium", "merge": merge, **({"sequence_by": sequence_by} if sequence_by else {})}
    settings = {"key": {"type": "json", "schema": "id BIGINT"}, "format": {"type": "json", "schema": ROW},
                "upsert": upsert, **overrides}
    return make_pipeline(topic, name="accounts", **settings)


def lsn(value):
    return value["source"]["lsn"]


def change(id_, op, at, **row):
    """A Debezium event of key ``id_`` (op c, u or d) at LSN ``at``; ``row``: the after image's values."""
    image = {"id": id_, "name": "ada", "balance": 0, **row}
    value = {"before": image if op in ("u", "d") else None, "after": None if op == "d" else image, "op": op,
             "ts_ms": 1_790_000_000_000 + at, "source": {"connector": "postgresql", "lsn": at}, "transaction": None}
    return ChangeEvent({"id": id_}, value, at)


def forget_commits_up_to(uri, version):
    """Log cleanup: a checkpoint at ``version``, the commit files up to it removed."""
    DeltaTable(uri, version=version).create_checkpoint()
    for log_file in Path(uri, "_delta_log").glob("*.json"):
        if int(log_file.stem) <= version:
            log_file.unlink()


@pytest.mark.parametrize("merge", ("local", "cluster"))  # upsert.merge: tests/commit/test_upsert.py's MERGES
def test_an_untouched_table_verifies_and_replays_and_a_row_changed_by_another_tool_is_named(
        merge, spark, broker, topic, make_pipeline):
    events = debezium_events(keys=30, changes=250, seed=5)
    half = len(events) // 2
    produce(broker.bootstrap_servers, topic, events[:half], "shuffled", seed=1)
    broker.produce(topic, [(0, b'{"id": 999}', b"{not json", None)])  # quarantined
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn", merge=merge,
                        limits={"max_records_per_commit": 60})
    run(pipeline, spark_factory=lambda: spark)
    produce(broker.bootstrap_servers, topic, events[half:], "shuffled", seed=2)
    run(pipeline, spark_factory=lambda: spark)
    uri = pipeline.sink.table_uri
    records = read_back(broker.bootstrap_servers, topic)
    expected = fold([r for r in records if r[4] != b"{not json"], sequence=lsn)
    assert table_state(uri).keys() == expected.keys()
    commits = [r for _, r in oncemore_commits(uri)]

    report = verify(pipeline, lambda: spark, replay=True)

    assert report.ok, report.describe()
    assert report.rows["main"] == len(expected) and report.rows["quarantine"] == 1
    assert report.events == {c: sum(r.records[c] for r in commits) for c in COUNTS}
    assert report.replayed["records"] == len(records) and report.replayed["same"] == len(expected)
    assert sum(report.replayed[s] for s in ("different", "missing", "extra", "unreplayed")) == 0
    assert report.offsets_without_row == 0
    assert "replay: " in report.describe() and "events: " in report.describe()

    assert expected[(3,)]["balance"] != 0
    DeltaTable(uri).update(updates={"balance": "0"}, predicate="id = 3")  # another writer, outside oncemore
    assert verify(pipeline, lambda: spark).ok, "from the tables alone, a changed value is invisible"

    changed = verify(pipeline, lambda: spark, replay=True)

    assert not changed.ok and changed.counts == {"replay": 1}, changed.describe()
    (found,) = changed.discrepancies
    row = expected[(3,)]
    assert (found.topic, found.partition, found.start) == (row["_kafka_topic"], row["_kafka_partition"],
                                                           row["_kafka_offset"])
    assert found.detail.startswith("key {'id': 3}: the table's row (from ") and " in balance" in found.detail
    assert f"changed outside oncemore by version(s) {DeltaTable(uri).version()} (UPDATE)" in found.detail

    env = {**os.environ, "PYTHONPATH": str(ROOT / "include")}
    said = subprocess.run([sys.executable, "-m", "oncemore.cli", "verify", "--config", pipeline.origin, "--replay",
                           "--master", "local[1]"], env=env, capture_output=True, text=True, timeout=600)
    assert said.returncode == 1 and said.stdout.startswith("accounts: FAILED"), said.stderr[-3000:]
    assert f"replay: {found.topic}/{found.partition} [{found.start}, {found.start + 1})" in said.stdout


def test_a_late_event_stays_stale_in_the_replay_against_forgotten_commits_and_held_deletes(
        spark, broker, topic, make_pipeline):
    produce(broker.bootstrap_servers, topic, [
        change(1, "c", 100, balance=1), change(1, "u", 200, balance=2),  # the row, by a commit to be forgotten
        change(2, "c", 110), change(2, "d", 210), ChangeEvent({"id": 2}, None, 210),  # a delete, held
        change(3, "c", 120, balance=3)], "key")
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn")
    run(pipeline, spark_factory=lambda: spark)
    uri = pipeline.sink.table_uri
    forgotten = DeltaTable(uri).version()
    produce(broker.bootstrap_servers, topic, [
        change(1, "u", 150, balance=99), change(2, "u", 160, balance=98),  # late: older than the row, the delete
        change(3, "u", 300, balance=33), change(4, "c", 310, balance=4)], "key")
    run(pipeline, spark_factory=lambda: spark)
    assert sum(r.records["stale"] for v, r in oncemore_commits(uri) if v > forgotten) == 2
    assert {k: r["balance"] for k, r in table_state(uri).items()} == {(1,): 2, (3,): 33, (4,): 4}
    forget_commits_up_to(uri, forgotten)  # the row of key 1 and the delete of key 2: outside every kept range
    compact = ConfigEntry("cleanup.policy", "compact,delete", incremental_operation=AlterConfigOpType.SET)
    for done in broker.admin().incremental_alter_configs(
            [ConfigResource("topic", topic, incremental_configs=[compact])]).values():
        done.result(timeout=30)  # as Debezium's topics are: every row weighed, its record may be gone

    report = verify(pipeline, lambda: spark, replay=True)

    assert report.ok, report.describe()
    assert not report.whole_log and report.rows["before"] == 1
    assert {s: report.replayed[s] for s in ("same", "unreplayed", "different", "missing", "extra")} == {
        "same": 2, "unreplayed": 1, "different": 0, "missing": 0, "extra": 0}, report.replayed

    # What the tables hold is weighed, not trusted blindly: a row of key 2 written by another tool
    # (at the late event's coordinates) is older than the held delete; key 3's row, given a newer
    # sequence in place, is still its event's row (its coordinates).
    late = next((t, p, o) for t, p, o, _, v in read_back(broker.bootstrap_servers, topic)
                if v is not None and json.loads(v)["op"] == "u" and json.loads(v)["after"]["id"] == 2)
    row = {**table_state(uri)[(3,)], "id": 2, "balance": 98, "_sequence": Decimal(160), "_kafka_topic": late[0],
           "_kafka_partition": late[1], "_kafka_offset": late[2]}
    write_deltalake(uri, pa.Table.from_pylist([row], schema=pa.schema(DeltaTable(uri).schema().to_arrow())),
                    mode="append")
    DeltaTable(uri).update(updates={"_sequence": "1000000"}, predicate="id = 3")

    changed = verify(pipeline, lambda: spark, replay=True)

    assert not changed.ok and changed.counts == {"replay": 2}, changed.describe()
    extra, different = sorted(changed.discrepancies, key=lambda d: d.detail)
    assert (extra.topic, extra.partition, extra.start) == late
    assert extra.detail.startswith("key {'id': 2}: the table holds a row (from this event) that the replay does "
                                   "not: a newer delete the tombstones table holds deletes the key ("), extra.detail
    assert different.detail.startswith("key {'id': 3}: the table's row (from ") and \
        "(from this event) in _sequence;" in different.detail, different.detail


def test_a_row_written_before_the_table_gained_a_column_replays_as_its_commit_wrote_it(
        spark, broker, topic, make_pipeline):
    then, now = (f"{ROW}, address STRUCT<city: STRING>",
                 f"{ROW}, address STRUCT<city: STRING, zip: STRING>, tier STRING")
    address = {"city": "Lyon", "zip": "69001"}  # the source's rows carry more than the table takes at first
    produce(broker.bootstrap_servers, topic, [change(1, "c", 100, address=address, tier="gold"),
                                              change(2, "c", 110, address=address, tier="gold")], "key")
    pipeline = debezium(make_pipeline, topic, format={"type": "json", "schema": then})
    run(pipeline, spark_factory=lambda: spark)
    produce(broker.bootstrap_servers, topic, [change(2, "u", 200, address=address, tier="silver"),
                                              change(3, "c", 210, address=address, tier="gold")], "key")
    pipeline = debezium(make_pipeline, topic, format={"type": "json", "schema": now})  # columns added
    run(pipeline, spark_factory=lambda: spark)
    rows = table_state(pipeline.sink.table_uri)
    assert (rows[(1,)]["address"], rows[(1,)]["tier"]) == ({"city": "Lyon", "zip": None}, None)
    assert (rows[(3,)]["address"], rows[(3,)]["tier"]) == (address, "gold")

    report = verify(pipeline, lambda: spark, replay=True)

    assert report.ok, report.describe()
    assert report.replayed["same"] == 3 and report.replayed["different"] == 0, report.replayed

    DeltaTable(pipeline.sink.table_uri).update(updates={"tier": "'platinum'"}, predicate="id = 1")  # another writer

    changed = verify(pipeline, lambda: spark, replay=True)

    assert not changed.ok and changed.counts == {"replay": 1}, changed.describe()
    (found,) = changed.discrepancies
    assert found.detail.startswith("key {'id': 1}: the table's row (from ") and "(from this event) in tier;" in \
        found.detail, found.detail


def test_a_key_on_two_rows_and_a_record_that_does_not_add_up_are_named(spark, broker, topic, make_pipeline):
    from oncemore.commit.committer import commit
    from oncemore.core.coordinates import KafkaPartition
    from oncemore.plan.commitinfo import CommitInfo
    from oncemore.plan.ledger import Ledger

    events = debezium_events(keys=20, changes=60, seed=3, tombstones=False)
    produce(broker.bootstrap_servers, topic, events, "key")
    pipeline = debezium(make_pipeline, topic)
    run(pipeline, spark_factory=lambda: spark)
    uri = pipeline.sink.table_uri
    assert verify(pipeline, lambda: spark, replay=True).ok

    rows = DeltaTable(uri).to_pyarrow_table().sort_by("id")
    first = rows.slice(0, 1)
    taken = set(zip(rows["_kafka_partition"].to_pylist(), rows["_kafka_offset"].to_pylist()))
    free = next((p, o) for _, p, o, _, _ in read_back(broker.bootstrap_servers, topic) if (p, o) not in taken)
    twin = first.set_column(first.schema.get_field_index("_kafka_partition"), first.schema.field("_kafka_partition"),
                            pa.array([free[0]], pa.int32()))
    twin = twin.set_column(twin.schema.get_field_index("_kafka_offset"), twin.schema.field("_kafka_offset"),
                           pa.array([free[1]], pa.int64()))  # the first row's key again, at a committed offset
    stray = first.set_column(first.schema.get_field_index("id"), first.schema.field("id"), pa.array([10_000], pa.int64()))
    stray = stray.set_column(stray.schema.get_field_index("_kafka_offset"), stray.schema.field("_kafka_offset"),
                             pa.array([10_000], pa.int64()))  # a key of its own, past every committed range
    write_deltalake(uri, pa.concat_tables([twin, stray]), mode="append")

    produce(broker.bootstrap_servers, topic, debezium_events(keys=12, changes=0, seed=9), "key")
    ledger = Ledger(uri, pipeline.name)
    partitions = [KafkaPartition(topic, p) for p in range(3)]
    held = ledger.positions(partitions)
    ends = {p: 1 + max(r[2] for r in read_back(broker.bootstrap_servers, topic) if r[1] == p.partition)
            for p in partitions}
    grown = max(partitions, key=lambda p: ends[p] - held[p])
    assert ends[grown] - held[grown] > 1
    record = CommitInfo(pipeline="accounts", run_id="miscounter",
                        ranges={topic: {str(grown.partition): [held[grown], ends[grown]]}},
                        records={"written": 1, "quarantined": 0, "filtered": 0, **dict.fromkeys(COUNTS, 0)})
    version = commit(ledger, [], {grown: held[grown]}, {grown: ends[grown]}, partitions, record).version

    report = verify(pipeline, lambda: spark)

    assert not report.ok and set(report.counts) == {"key", "count", "outside"}, report.describe()
    (outside,) = [d for d in report.discrepancies if d.kind == "outside"]
    assert (outside.partition, outside.start) == (first["_kafka_partition"][0].as_py(), 10_000)
    (key,) = [d for d in report.discrepancies if d.kind == "key"]
    assert key.detail.startswith(f"key {{'id': {first['id'][0].as_py()}}} is on 2 rows of the table")
    (count,) = [d for d in report.discrepancies if d.kind == "count"]
    assert (count.topic, count.partition, count.start, count.end, count.versions) == (
        topic, grown.partition, held[grown], ends[grown], (version,))
    assert count.detail == (f"commit {version} (run miscounter, 1 partition(s)) wrote 1 change row(s), its events add "
                            "up to 0 (0 inserted, 0 updated, 0 deleted, 0 noop_deletes, 0 stale, 0 superseded, "
                            "0 tombstones)")

    replayed = verify(pipeline, lambda: spark, replay=True)  # Kafka holds more records than the record says
    holds = ends[grown] - held[grown]
    assert any(d.detail.endswith(f"accounts for 1 record(s) (1 written + 0 quarantined + 0 filtered), Kafka holds "
                                 f"{holds} in its ranges") for d in replayed.discrepancies), replayed.describe()
    assert replayed.replayed["unreplayed"] == 1, "the stray row: verify names it, the replay has no event of it"


def test_a_replay_kafka_can_no_longer_serve_is_refused_by_name_and_an_append_table_has_none(
        spark, broker, topic, make_pipeline):
    produce(broker.bootstrap_servers, topic, debezium_events(keys=12, changes=40, seed=4), "key")
    pipeline = debezium(make_pipeline, topic, limits={"max_records_per_commit": 30})
    run(pipeline, spark_factory=lambda: spark)
    (version, record), *_ = oncemore_commits(pipeline.sink.table_uri)
    p, (start, end) = max(record.partition_ranges().items(), key=lambda item: item[0].partition)
    assert end - start > 1
    first = {0: Piece(p, start, start + 1, (version,))}
    assert replayable(pipeline, first) == Replayable(frozenset())
    compact = ConfigEntry("cleanup.policy", "compact,delete", incremental_operation=AlterConfigOpType.SET)
    for done in broker.admin().incremental_alter_configs(
            [ConfigResource("topic", topic, incremental_configs=[compact])]).values():
        done.result(timeout=30)
    assert replayable(pipeline, first) == Replayable(frozenset({topic})), "its commits may account for more records"
    broker.delete_records(topic, {p.partition: start + 1})  # retention passed the first record

    with pytest.raises(ReplayImpossible) as refused:
        verify(pipeline, lambda: spark, replay=True)

    assert str(refused.value).startswith(
        f"pipeline accounts: verify --replay: {p} offsets [{start}, {end}), committed by version(s) {version}, are no "
        f"longer all in Kafka (its log holds [{start + 1}, ")
    assert refused.value.evidence["log_start"] == start + 1
    assert verify(pipeline, lambda: spark).ok, "the tables alone still verify"

    appends = make_pipeline(topic, name="orders")
    with pytest.raises(ConfigError, match="verify --replay compares an upsert table with its change events; this "
                                          "pipeline appends"):
        verify(appends, lambda: spark, replay=True)
    said = oncemore("verify", "--config", appends.origin, "--replay")
    assert said.returncode == 2 and "upsert: verify --replay compares an upsert table" in said.stderr, said.stderr


def test_status_and_the_oncemore_page_show_what_each_batch_did(spark, broker, topic, make_pipeline):
    sys.path.insert(0, str(ROOT / "plugins"))
    from oncemore.report.overview import pipeline_overview
    from oncemore.report.status import format_status, status
    from oncemore_airflow.ui import templates

    produce(broker.bootstrap_servers, topic, debezium_events(keys=15, changes=90, seed=6), "shuffled", seed=5)
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn", limits={"max_records_per_commit": 40})
    run(pipeline, spark_factory=lambda: spark)
    newest_first = oncemore_commits(pipeline.sink.table_uri)[::-1]
    expected = [{"version": v, "batch_seq": r.batch_seq, **{c: r.records[c] for c in SHOWN}} for v, r in newest_first]
    assert len(expected) > 1 and all(sum(b[c] for b in expected) for c in SHOWN), expected

    data = status(pipeline)
    shown = [{k: b[k] for k in ("version", "batch_seq", *SHOWN)} for b in data["upsert"]["batches"]]
    assert shown == expected and data["upsert"]["keys"] == ["id"]
    said = json.loads(oncemore("status", "--config", pipeline.origin, "--json").stdout)
    assert said["upsert"]["batches"] == data["upsert"]["batches"]
    text = format_status(data).splitlines()
    for batch in expected:
        (line,) = [t for t in text if t.split() and t.split()[0] == str(batch["version"])]
        assert line.split()[-4:] == [str(batch[c]) for c in SHOWN], line

    overview = pipeline_overview(pipeline)
    assert [{k: b[k] for k in ("version", "batch_seq", *SHOWN)} for b in overview["batches"]] == expected
    page = templates.get_template("pipeline.html").render(  # the pipeline's page lists its batches
        **pipeline_overview(pipeline, detail=True), error=None, dag_id="oncemore_accounts", charts={}, seconds=0.1)
    newest = page.split(f'<tr data-version="{expected[0]["version"]}">')[1].split("</tr>")[0]
    for c in SHOWN:
        assert f'<td class="{c}">{expected[0][c]}</td>' in newest, newest

    appends = make_pipeline(topic, name="orders")  # an append pipeline: its status and page as they were
    assert "upsert" not in status(appends)
    page = templates.get_template("pipeline.html").render(
        **pipeline_overview(appends, detail=True), error=None, dag_id="oncemore_orders", charts={}, seconds=0.1)
    assert "<th>written</th><th>quarantined</th>" in page and "inserted" not in page


def test_maintain_forgets_tombstones_by_the_streams_time_not_the_wall_clock(spark, broker, topic, make_pipeline):
    """The issue's outage: retention 1 h; ingestion stops two hours (of wall clock) short of the
    log's end; maintain keeps the delete, whose Kafka time the committed progress has not left an
    hour behind; the late, older update is then stale. Once the stream's time is an hour past
    the delete, maintain forgets it, and compacts the tombstones table."""
    from oncemore.config.values import OffsetBound
    from oncemore.ops.maintain import maintain, stream_time_ms

    upsert = {"keys": ["id"], "envelope": "debezium", "sequence_by": "source.lsn", "tombstone_retention_hours": 1}
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": ROW}, upsert=upsert)
    start = int(datetime.now(timezone.utc).timestamp() * 1000) - 10 * 3_600_000
    minute = 60_000
    encoded = lambda event: json.dumps(event.value).encode() if event.value is not None else None  # noqa: E731
    records = [(0, b'{"id": 1}', encoded(change(1, "c", 10)), start), (1, b'{"id": 2}', encoded(change(2, "c", 11)), start),
               (0, b'{"id": 1}', encoded(change(1, "d", 30)), start + 10 * minute), (0, b'{"id": 1}', None, start + 10 * minute),
               (1, b'{"id": 2}', encoded(change(2, "u", 40)), start + 20 * minute),
               # the outage: what ingestion has not reached yet (an hour past the delete, in Kafka's time)
               (0, b'{"id": 3}', encoded(change(3, "c", 50)), start + 80 * minute),
               (1, b'{"id": 1}', encoded(change(1, "u", 20, name="late")), start + 90 * minute)]  # older than the delete
    broker.produce(topic, records)
    bound = datetime.fromtimestamp((start + 30 * minute) / 1000, timezone.utc).isoformat()
    run(pipeline, until=OffsetBound.parse(bound), spark_factory=lambda: spark)
    uri = pipeline.sink.tombstones_uri
    assert stream_time_ms(pipeline) == start + 10 * minute  # partition 0's; partition 1 reached 20 minutes
    # Two hours pass with no commit: the delete was applied two hours ago by the wall clock.
    DeltaTable(uri).update(updates={"_deleted_at": f"'{(datetime.now(timezone.utc) - timedelta(hours=2)).isoformat()}'"})

    assert maintain(pipeline)["tables"]["tombstones"]["tombstones_forgotten"] == 0
    run(pipeline, spark_factory=lambda: spark)  # the outage ends: the late update is stale
    expected = fold(read_back(broker.bootstrap_servers, topic), sequence=lsn)
    assert set(table_state(pipeline.sink.table_uri)) == set(expected) == {(2,), (3,)}
    assert oncemore_commits(pipeline.sink.table_uri)[-1][1].records["stale"] == 1

    # Caught up: the stream's time is the commit's, ten hours past the delete.
    done = maintain(pipeline)
    assert done["tables"]["tombstones"]["tombstones_forgotten"] == 1, done
    assert done["tables"]["tombstones"]["status"] == "maintained"
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 0
    without = debezium(make_pipeline, topic)  # no sequence_by: no tombstones table
    assert set(maintain(without)["tables"]) == {"main", "quarantine"}
