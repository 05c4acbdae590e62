"""The real Airflow services (scheduler, DAG processor, API server; LocalExecutor on SQLite): an
hourly pipeline with catch-up runs its past intervals, each landing exactly the records stamped in
its own data interval (as the DagRun states it), the first ingest task SIGKILLed right after its
main commit and retried by Airflow itself; a backfill over them through the REST API (the call
Airflow's UI makes) and one through `airflow backfill create` commit nothing new."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

import pytest
import yaml
from deltalake import DeltaTable

from conftest import ROOT, assert_exactly_once, oncemore_commits, read_pairs
from oncemore.config.loading import load_pipeline
from oncemore.report.verify import verify

sys.path.insert(0, str(ROOT / "plugins"))
from devtools.airflowservices import start_airflow, wait_for  # noqa: E402

pytestmark = [pytest.mark.airflow, pytest.mark.spark]
DAG_ID = "oncemore__events"


def event(i: int) -> bytes:
    return json.dumps({"id": i, "customer": f"c{i % 7}", "amount": 1.5}).encode()


@pytest.fixture
def airflow_services(tmp_path, broker):
    """Starts the services once the test's data is in Kafka (the first catch-up run plans at once)."""
    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "events.yaml").write_text(yaml.safe_dump({
        "name": "events", "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": "events"},
        "sink": {"table_uri": str(tmp_path / "delta" / "events")},
        "format": {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE"},
        "airflow": {"schedule": "0 * * * *", "start_date": start.isoformat(),
                    # Three catch-up runs, also if the hour turns while the test runs.
                    "end_date": (start + timedelta(hours=2)).isoformat(), "catchup": True, "retries": 1,
                    "retry_delay_minutes": 0.05},
    }))
    (tmp_path / "faults").mkdir()
    started = []

    def start_services():
        # The first task to reach the main commit's step dies there, with its spark-submit (core/crashpoints.py).
        started.append(start_airflow(tmp_path / "airflow", {
            "ONCEMORE_PIPELINES_DIR": str(tmp_path / "pipelines"), "ONCEMORE_FAULTS": "main_committed",
            "ONCEMORE_FAULTS_ONCE": str(tmp_path / "faults")}))
        return started[-1]

    yield start_services, start, str(tmp_path / "delta" / "events")
    for services in started:
        services.stop()


def all_succeeded(services, count: int):
    runs = services.dag_runs(DAG_ID)
    failed = [r for r in runs if r["state"] == "failed"]
    assert not failed, f"failed runs: {[r['dag_run_id'] for r in failed]}"
    return len(runs) >= count and all(r["state"] == "success" for r in runs) and runs


def backfills_done(services, dag_id: str, at_least: int):
    """All of the DAG's backfills (at least ``at_least``) are completed."""
    backfills = services.api("GET", f"/api/v2/backfills?dag_id={dag_id}")["backfills"]
    return len(backfills) >= at_least and all(b["completed_at"] for b in backfills) and backfills


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def assert_runs_hold_their_intervals(runs: list[dict], table_uri: str, topic: str,
                                     stamped: dict[tuple[int, int], int], per_run: int) -> None:
    """Each DagRun's commits hold exactly the records (of ``stamped``: (partition, offset) ->
    timestamp ms) stamped in its own data interval, ``per_run`` of them."""
    commits = oncemore_commits(table_uri)
    for run in runs:
        low, high = (parse(run[k]).timestamp() * 1000 for k in ("data_interval_start", "data_interval_end"))
        expected = sorted(pair for pair, ms in stamped.items() if low <= ms < high)
        ranges = [r for _, record in commits if record.run_id == run["dag_run_id"]
                  for r in record.ranges[topic].items()]
        landed = sorted((int(p), o) for p, (s, e) in ranges for o in range(s, e) if (int(p), o) in stamped)
        assert landed == expected and len(expected) == per_run, run["dag_run_id"]


def test_catch_up_intervals_land_exactly_and_backfills_over_them_commit_nothing(broker, airflow_services, spark):
    start_services, start, table_uri = airflow_services
    broker.create_topic("events", 3)
    produced, stamped = [], {}
    for h in range(4):  # three past hours and the current one, some in transactions
        base = int((start + timedelta(hours=h)).timestamp() * 1000)
        records = [(i % 3, None, event(h * 1000 + i), base + i * 10_000) for i in range(120)]
        delivered = broker.produce("events", records, transactional_id="events-tx" if h % 2 else None)
        produced += delivered
        stamped.update({pair: record[3] for pair, record in zip(delivered, records)})

    services = start_services()
    runs = wait_for(lambda: all_succeeded(services, 3), 900, "three catch-up runs", 5)

    assert [parse(r["data_interval_start"]) for r in runs] == [start + timedelta(hours=h) for h in range(3)]
    assert_runs_hold_their_intervals(runs, table_uri, "events", stamped, per_run=120)
    in_past_hours = [pair for pair in produced if stamped[pair] < (start + timedelta(hours=3)).timestamp() * 1000]
    assert_exactly_once(read_pairs(table_uri), in_past_hours)
    # One ingest task was killed after its commit landed; Airflow's retry found the batch committed.
    tries = {r["dag_run_id"]: services.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{r['dag_run_id']}/taskInstances/"
                                                  "ingest")["try_number"] for r in runs}
    assert sorted(tries.values()) == [1, 1, 2], tries
    killed = next(run_id for run_id, tried in tries.items() if tried == 2)
    states = [t["state"] for t in services.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{killed}/taskInstances/ingest/"
                                                      "tries")["task_instances"]]
    assert states == ["failed", "success"] or states == ["up_for_retry", "success"], states
    assert verify(load_pipeline(services.home.parent / "pipelines" / "events.yaml"), lambda: spark).ok
    version = DeltaTable(table_uri).version()

    backfill = services.create_backfill({
        "dag_id": DAG_ID, "from_date": start.isoformat(), "to_date": (start + timedelta(hours=1)).isoformat(),
        "reprocess_behavior": "completed", "max_active_runs": 1})
    wait_for(lambda: services.api("GET", f"/api/v2/backfills/{backfill['id']}")["completed_at"], 600, "the REST backfill", 5)
    # Airflow allows one active backfill per DAG; on SQLite a create retried after a 503 may have
    # left a second one over the same hours (re-running them once more, committing nothing).
    wait_for(lambda: backfills_done(services, DAG_ID, 1), 600, "every backfill of the DAG", 5)
    # On SQLite a create answered 503 can also stop after its first runs (Airflow adds them one by
    # one; seen once in the full suite): each hour it left out gets a backfill of its own.
    for run in services.dag_runs(DAG_ID):
        if run["run_type"] != "backfill" and parse(run["logical_date"]) <= start + timedelta(hours=1):
            again = services.create_backfill({"dag_id": DAG_ID, "from_date": run["logical_date"],
                                              "to_date": run["logical_date"], "reprocess_behavior": "completed",
                                              "max_active_runs": 1})
            wait_for(lambda: services.api("GET", f"/api/v2/backfills/{again['id']}")["completed_at"], 600,
                     "the backfill of an hour the first left out", 5)
    done_before_cli = len(services.api("GET", f"/api/v2/backfills?dag_id={DAG_ID}")["backfills"])
    # On SQLite the CLI's write can meet the scheduler's lock, and in the full suite the CLI has
    # seen the finished REST backfill as still active for a while (AlreadyRunningBackfill) after
    # the API reported it completed: both are retried for up to two minutes.
    for attempt in range(24):
        created = subprocess.run([sys.executable, "-m", "airflow", "backfill", "create", "--dag-id", DAG_ID,
                                  "--from-date", (start + timedelta(hours=2)).isoformat(),
                                  "--to-date", (start + timedelta(hours=2)).isoformat(),
                                  "--reprocess-behavior", "completed"],
                                 env=services.env, capture_output=True, text=True, timeout=300)
        if created.returncode == 0 or not any(
                why in created.stderr for why in ("database is locked", "AlreadyRunningBackfill")):
            break
        time.sleep(5)
    assert created.returncode == 0, (created.stderr[-3000:], services.api("GET", f"/api/v2/backfills?dag_id={DAG_ID}"))

    wait_for(lambda: backfills_done(services, DAG_ID, done_before_cli + 1), 600, "the CLI backfill", 5)
    # Airflow re-runs the existing runs of those intervals (same run ids) as backfill runs.
    runs = wait_for(lambda: all_succeeded(services, 3), 300, "the backfill runs", 5)
    assert [r["run_type"] for r in runs] == ["backfill"] * 3
    assert DeltaTable(table_uri).version() == version, "a backfill over ingested hours commits nothing"
    assert_exactly_once(read_pairs(table_uri), in_past_hours)
