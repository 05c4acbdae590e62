"""Operating a pipeline: maintenance beside ingestion, the consumer-group mirror for lag tools,
freshness alerts, progress, and the overview the oncemore page shows."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from conftest import (
    assert_exactly_once,
    committed_offsets,
    held_positions,
    keyed,
    oncemore,
    oncemore_commits,
    orders,
    read_pairs,
)
from oncemore.commit.groupmirror import GroupMirror
from oncemore.commit.inputs import STAGING_DIR
from oncemore.config.schedule import VACUUM_RETENTION_FLOOR_HOURS
from oncemore.config.values import ConfigError, OffsetBound
from oncemore.plan import ledger
from oncemore.plan.ledger import Ledger
from oncemore.report.overview import pipeline_overview
from oncemore.report.status import FreshnessAlert, check_freshness, status
from oncemore.run.progress import Progress
from oncemore.run.runner import run


def spark_factory(spark):
    return lambda: spark


@pytest.mark.spark
def test_maintenance_beside_ingestion_keeps_every_record_once_and_the_positions(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 6_000) + [(1, b"bad", b"{not json", None)])
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 300},
                             maintenance={"target_file_size_mb": 1, "vacuum_retention_hours": VACUUM_RETENTION_FLOOR_HOURS})
    run(pipeline, until=first_offsets(200), spark_factory=spark_factory(spark))  # the tables exist, with small files
    # A file an ingestion has written but not committed yet: vacuum must leave it alone.
    in_flight = Path(pipeline.sink.table_uri) / "part-in-flight.parquet"
    pq.write_table(pa.table({"id": [1]}), in_flight)

    ingestion: dict = {}
    thread = threading.Thread(target=lambda: ingestion.update(report=run(pipeline, spark_factory=spark_factory(spark))))
    thread.start()
    maintained_during = []
    while thread.is_alive():
        done = oncemore("maintain", "--config", pipeline.origin)
        assert done.returncode == 0, done.stderr[-3000:]
        maintained_during.append(thread.is_alive())
    thread.join()

    assert "report" in ingestion, "the ingestion finished"
    assert any(maintained_during), "maintenance ran while ingestion committed"
    assert_exactly_once(read_pairs(pipeline.sink.table_uri) + read_pairs(pipeline.sink.quarantine_uri), produced)
    assert held_positions(pipeline.sink.table_uri, pipeline.name, topic) == {
        p: max(o for q, o in produced if q == p) + 1 for p in (0, 1, 2)}
    assert in_flight.exists(), "vacuum deleted a file younger than the retention floor"

    # Staging directories of parts whose runs died: those older than the retention go, a live one stays.
    staging = Path(pipeline.sink.quarantine_uri) / STAGING_DIR
    abandoned, live = staging / "run-abandoned-0-1", staging / "run-live-0-2"
    for directory in (abandoned, live):
        directory.mkdir(parents=True)
        (directory / "range-x.json").write_text("{}")
    long_ago = time.time() - (VACUUM_RETENTION_FLOOR_HOURS + 1) * 3600
    os.utime(abandoned, (long_ago, long_ago))
    final = oncemore("maintain", "--config", pipeline.origin)
    tables = json.loads(final.stdout)["tables"]
    assert tables["main"]["status"] == tables["quarantine"]["status"] == "maintained"
    assert tables["quarantine"]["staging_removed"] == 1 and not abandoned.exists() and live.exists()
    operations = [c["operation"] for c in DeltaTable(pipeline.sink.table_uri).history()]
    assert "OPTIMIZE" in operations
    # Compacted: fewer files than the ingestion's commits wrote, and a checkpoint of the last version.
    assert len(DeltaTable(pipeline.sink.table_uri).file_uris()) < len(oncemore_commits(pipeline.sink.table_uri))
    assert (Path(pipeline.sink.table_uri) / "_delta_log" / "_last_checkpoint").exists()


def test_vacuum_retention_below_the_floor_is_refused(make_pipeline, topic):
    with pytest.raises(ConfigError, match=f"maintenance.vacuum_retention_hours: .*{VACUUM_RETENTION_FLOOR_HOURS}"):
        make_pipeline(topic, maintenance={"vacuum_retention_hours": 1})


@pytest.mark.spark
def test_positions_are_mirrored_to_the_consumer_group_and_never_read_back(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 900))
    pipeline = make_pipeline(topic, commit_consumer_group=True, limits={"max_records_per_commit": 400})
    run(pipeline, spark_factory=spark_factory(spark))

    ends = {p: max(o for q, o in produced if q == p) + 1 for p in (0, 1, 2)}
    assert committed_offsets(broker, pipeline) == ends
    # The mirror is never read back: moved behind the table, the next run still starts at the table.
    assert GroupMirror(pipeline).mirror(keyed(topic, {0: 0, 1: 0, 2: 0}), table_version=0)
    more = broker.produce(topic, orders(900, 90))
    run(pipeline, spark_factory=spark_factory(spark))
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced + more)
    assert committed_offsets(broker, pipeline) == {p: max(o for q, o in produced + more if q == p) + 1 for p in (0, 1, 2)}


def test_a_failed_mirror_is_logged_and_kept_not_raised(make_pipeline, topic, caplog):
    """The mirror never gates a commit: a failure is logged and kept for the run to fail on once its
    commits are done (runner)."""
    pipeline = make_pipeline(topic, source={"bootstrap_servers": "127.0.0.1:1", "stall_timeout_seconds": 2})
    started = time.monotonic()
    mirror = GroupMirror(pipeline)
    with caplog.at_level(logging.WARNING, logger="oncemore"):
        assert mirror.mirror(keyed(topic, {0: 5}), table_version=3) is False
    assert time.monotonic() - started < 30
    assert f"could not mirror positions of topic {topic} (table version 3) to consumer group oncemore.orders" in caplog.text
    assert mirror.failure.startswith("pipeline orders: could not mirror table version 3 to consumer group oncemore.orders: ")


def test_freshness_alert_names_the_partition_beyond_the_limits(broker, topic, make_pipeline):
    stamp = int(time.time() * 1000) - 30 * 60_000  # half an hour ago, nothing ingested
    broker.produce(topic, [(1, None, b"{}", stamp + i) for i in range(150)] + [(2, None, b"{}", None)])
    pipeline = make_pipeline(topic, alert={"max_lag_records": 100, "max_lag_minutes": 10})

    rows = {r["partition"]: r for r in status(pipeline)["partitions"]}
    assert rows[1]["lag"] == 150 and 29 * 60 < rows[1]["lag_seconds"] < 40 * 60
    assert rows[0]["lag"] == 0 and rows[0]["lag_seconds"] == 0
    with pytest.raises(FreshnessAlert) as alert:
        check_freshness(pipeline, list(rows.values()))
    message = str(alert.value)
    assert f"{topic}/1: 150 records behind (limit 100" in message
    assert f"{topic}/1: oldest record not ingested is " in message and "(limit 10" in message
    assert f"{topic}/2" not in message and f"{topic}/0" not in message
    check_freshness(make_pipeline(topic, name="relaxed", alert={"max_lag_records": 1000}), list(rows.values()))


def test_progress_is_a_json_line_off_a_terminal_and_one_rewritten_line_on_one(caplog):
    with caplog.at_level(logging.INFO, logger="oncemore.progress"):
        progress = Progress("orders", batches=2, offsets=1000, stream=io.StringIO())
        time.sleep(1.0)  # Spark starting: not in the rate
        progress.begin()
        time.sleep(0.2)
        figures = progress.advance(0, 400, 398, 52_000)
    line = json.loads(caplog.records[-1].getMessage())
    # Batches are numbered as the plan, the log and the commit records number them.
    assert line == figures and line["event"] == "progress" and line["batch"] == 0 and line["batches"] == 2
    assert line["seconds"] < 0.5
    assert (line["offsets_done"], line["offsets_total"], line["records"], line["bytes"]) == (400, 1000, 398, 52_000)
    assert 0 < line["records_per_second"] <= 2_000 and line["eta_seconds"] == pytest.approx(
        600 / line["records_per_second"], abs=0.1)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = Progress("orders", batches=2, offsets=1000, stream=terminal)
    progress.advance(0, 400, 400, 52_000)
    progress.advance(1, 600, 600, 78_000)
    first, second = terminal.getvalue().split("\r")[1:]
    assert first.startswith("orders: batch 0 (of 2),  40.0% of 1,000 offsets, 400 records, 50.8 KiB") and "ETA" in first
    assert second.startswith("orders: batch 1 (of 2), 100.0% of 1,000 offsets, 1,000 records, 127.0 KiB")
    assert second.endswith("\n")


@pytest.mark.spark
def test_the_overview_matches_the_ledger(broker, topic, make_pipeline, spark):
    produced = broker.produce(topic, orders(0, 600) + [(0, b"k", b"\x00\x01 not json", None)])
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 250})
    run(pipeline, until=first_offsets(150), spark_factory=spark_factory(spark))

    data = pipeline_overview(pipeline, detail=True)
    commits = Ledger(pipeline.sink.table_uri, pipeline.name).recent_batches(100)
    assert [b["version"] for b in data["batches"]] == [e.version for e in commits]
    assert data["last_commit"]["version"] == DeltaTable(pipeline.sink.table_uri).version()
    assert sum(h["written"] for h in data["per_hour"]) == sum(e.record.records["written"] for e in commits)
    assert [p["lag"] for p in data["lag_after_commit"]] == [sum(e.record.lag().values()) for e in reversed(commits)]
    # The last batch left the records after the bound: the lag the plan saw, and the lag now.
    assert data["lag_after_commit"][-1]["lag"] == sum(r["lag"] for r in data["partitions"]) == len(produced) - 3 * 150
    assert all(b["duration_seconds"] > 0 for b in data["batches"])
    assert data["quarantine_sample"] == [], "the record that is not JSON lies after the bound"

    run(pipeline, spark_factory=spark_factory(spark))
    (sample,) = pipeline_overview(pipeline, detail=True)["quarantine_sample"]
    assert sample["value_head"] == "\\x00\\x01 not json" and sample["error"] == "value is not valid JSON, not a JSON object"


def first_offsets(count: int) -> OffsetBound:
    """A bound ending each of the three partitions after its first ``count`` offsets."""
    return OffsetBound.parse(json.dumps({str(p): count for p in (0, 1, 2)}))


class SnapshotReads:
    """Counts snapshot loads of existing tables (constructions) and commit files read."""

    def __init__(self, monkeypatch):
        self.loads = self.commits_read = 0
        init, read_commit = DeltaTable.__init__, ledger._read_commit

        def counted_init(table, *args, **kwargs):
            init(table, *args, **kwargs)
            self.loads += 1

        def counted_read(*args):
            self.commits_read += 1
            return read_commit(*args)

        monkeypatch.setattr(DeltaTable, "__init__", counted_init)
        monkeypatch.setattr(ledger, "_read_commit", counted_read)


@pytest.mark.spark
def test_a_snapshot_is_loaded_once_per_table_and_the_page_reads_only_new_commits(broker, make_pipeline, spark, monkeypatch):
    reads = SnapshotReads(monkeypatch)
    loads = {}
    for batches in (1, 4):
        topic = f"snapshots_{batches}"
        broker.create_topic(topic, 3)
        broker.produce(topic, orders(0, 1_200))
        pipeline = make_pipeline(topic, name=f"snapshots_{batches}", limits={"max_records_per_commit": 1_200 // batches})
        run(pipeline, spark_factory=spark_factory(spark))  # creates the tables
        broker.produce(topic, orders(1_200, 1_200))
        reads.loads = 0
        report = run(pipeline, spark_factory=spark_factory(spark))
        assert len(report.batches) == batches
        loads[batches] = reads.loads
    # Planning (the main table's positions, and the quarantine table's: is a crashed part's main
    # commit pending?), the table check and the run's two ledgers: never a load per batch or per question.
    assert loads[4] == loads[1] <= 6, loads

    pipeline_overview(pipeline, detail=True)
    reads.loads = reads.commits_read = 0
    pipeline_overview(pipeline, detail=True)
    assert (reads.loads, reads.commits_read) == (0, 0)
    broker.produce(pipeline.source.topic, orders(2_400, 30))
    run(pipeline, spark_factory=spark_factory(spark))
    reads.loads = reads.commits_read = 0
    pipeline_overview(pipeline, detail=True)
    assert (reads.loads, reads.commits_read) == (0, 1), "the page reads the one new commit"
