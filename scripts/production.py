"""The production topology on this machine: an S3 API server (moto) for the tables, a Spark standalone
master and worker for the jobs, the real Airflow services (scheduler, DAG processor, API server)
and a local Apache Kafka broker (or the cluster in KAFKA_BOOTSTRAP). Runs an hourly pipeline's
catch-up of the last three hours under the scheduler, then a backfill through the REST API over
them; prints what landed per interval; stops everything it started."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml
from deltalake import DeltaTable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

from devtools import kafkabroker  # noqa: E402
from devtools.airflowservices import start_airflow, wait_for  # noqa: E402
from devtools.s3server import start_s3_server  # noqa: E402
from devtools.sparkcluster import start_spark_cluster  # noqa: E402
from oncemore.plan.ledger import METADATA_KEY, CommitInfo  # noqa: E402

DAG_ID = "oncemore__orders_hourly"


def step(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:6.1f}s] {text}", flush=True)


def main() -> None:
    started = time.monotonic()
    work = Path(os.environ.get("ONCEMORE_DATA_DIR") or tempfile.mkdtemp(prefix="oncemore-production-"))
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    start = hour - timedelta(hours=3)
    with ExitStack() as stack:
        if os.environ.get("KAFKA_BOOTSTRAP"):
            broker = kafkabroker.DevBroker(os.environ["KAFKA_BOOTSTRAP"])
        else:
            broker = kafkabroker.start_kafka()
            stack.callback(broker.stop)
        s3 = start_s3_server()
        stack.callback(s3.stop)
        s3.create_bucket("lake")
        cluster = start_spark_cluster(log_dir=str(work / "spark"))
        stack.callback(cluster.stop)
        step(started, f"Kafka at {broker.bootstrap_servers}, S3 at {s3.endpoint}, Spark at {cluster.master_url}")

        topic = f"orders_{int(time.time())}"
        broker.create_topic(topic, 3)
        for h in range(3):  # records stamped in each of the last three hours
            base = int((start + timedelta(hours=h)).timestamp() * 1000)
            broker.produce(topic, [(i % 3, str(i).encode(), json.dumps(
                {"id": h * 10_000 + i, "customer": f"customer-{i % 97}", "amount": round(i * 1.25, 2)}).encode(),
                base + i * 1_000) for i in range(3_000)])
        options = {**s3.storage_options(), "AWS_SECRET_ACCESS_KEY": "${ONCEMORE_S3_SECRET}"}
        (work / "pipelines").mkdir(parents=True, exist_ok=True)
        (work / "pipelines" / "orders_hourly.yaml").write_text(yaml.safe_dump({
            "name": "orders_hourly", "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic},
            "sink": {"table_uri": "s3://lake/delta/orders_hourly", "storage_options": options},
            "format": {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE"},
            "airflow": {"schedule": "0 * * * *", "start_date": start.isoformat(), "catchup": True, "retries": 0},
        }))
        step(started, f"produced 9,000 records to {topic}, stamped over [{start:%H:%M}, {hour:%H:%M}) UTC")

        airflow = start_airflow(work / "airflow", {
            "ONCEMORE_PIPELINES_DIR": str(work / "pipelines"),
            "ONCEMORE_S3_SECRET": s3.storage_options()["AWS_SECRET_ACCESS_KEY"],
            "AIRFLOW_CONN_ONCEMORE_SPARK": json.dumps({"conn_type": "spark", "host": cluster.master_url}),
        })
        stack.callback(airflow.stop)
        step(started, f"Airflow scheduler, DAG processor and API server up at {airflow.url} (log in as "
                      f"{airflow.username}, password in {airflow.env['AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE']}; "
                      f"logs in {airflow.home})")

        def finished(count: int):
            runs = airflow.dag_runs(DAG_ID)
            if any(r["state"] == "failed" for r in runs):
                sys.exit(f"a DAG run failed; task logs under {airflow.home}")
            return len(runs) >= count and all(r["state"] == "success" for r in runs) and runs

        runs = wait_for(lambda: finished(3), 1200, "the three catch-up runs", 5)
        step(started, "catch-up done: " + ", ".join(f"{r['data_interval_start'][11:16]} {r['state']}" for r in runs))
        backfill = airflow.create_backfill({
            "dag_id": DAG_ID, "from_date": start.isoformat(), "to_date": (hour - timedelta(hours=1)).isoformat(),
            "reprocess_behavior": "completed", "max_active_runs": 1})
        wait_for(lambda: airflow.api("GET", f"/api/v2/backfills/{backfill['id']}")["completed_at"], 1200,
                 "the backfill", 5)
        wait_for(lambda: finished(3), 600, "the backfill runs", 5)  # the same runs, re-run as backfill runs
        step(started, f"REST backfill {backfill['id']} over the same hours done")
        report(DeltaTable("s3://lake/delta/orders_hourly", storage_options=s3.storage_options()))


def report(table: DeltaTable) -> None:
    print(f"\ns3://lake/delta/orders_hourly: version {table.version()}, {table.count()} rows")
    for entry in sorted((c for c in table.history() if METADATA_KEY in c), key=lambda c: c["version"]):
        record = CommitInfo.from_json(entry[METADATA_KEY])
        ranges = ", ".join(f"{p}: [{s}, {e})" for p, (s, e) in sorted(next(iter(record.ranges.values())).items()))
        print(f"  version {entry['version']}: run {record.run_id}: {record.records['written']} rows, ranges {ranges}")


if __name__ == "__main__":
    main()
