"""A hundred pipelines on one Airflow, as a platform runs them: the real scheduler, DAG processor
and API server (LocalExecutor on SQLite, devtools.airflowservices) and one resident Spark Connect
server every ingest task runs on, its slots bounded by one Airflow pool (``airflow.pool``). The
pipelines mix formats (flat JSON, nested JSON, Avro through the registry) and partition counts (1 to
12); each is scheduled on intervals of ``--interval-minutes`` and runs two of them as the scheduler
starts them, records arriving in each.

    scripts/benchmark fleet [--pipelines 100] [--interval-minutes 10] [--slots 2] [--records 100]

Prints the DAG folder's parse time, the scheduler's delay from an interval's end to its plan task's
start, each run's wall time (median, p95), each interval's total (its end to its last run's end),
the Connect server's peak memory (its process tree), and whether every table holds exactly the
records stamped before its second interval's end, counted by (partition, offset). Figures, not
verdicts: it fails only when a run fails or a table is not exact.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.compute as pc
import yaml
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from deltalake import DeltaTable
from peers import Tree
from throughput import AVRO_SCHEMA, FLAT, NESTED

from devtools import kafkabroker
from devtools.airflowservices import start_airflow, wait_for
from devtools.schemaregistry import start_registry
from devtools.sparkconnect import start_connect_server

ROOT = Path(__file__).resolve().parents[1]
POOL = "oncemore_spark"


def value_of(kind: str, i: int, serialize) -> bytes:
    if kind == "nested":
        return json.dumps({"id": i, "customer": {"name": f"c{i % 97}", "address": {"zip": f"{i % 99_999:05d}",
                                                                                "city": "Oslo"}},
                           "lines": [{"sku": f"s{i % 500}", "price": f"{i % 1000}.25"}],
                           "placed": "2026-11-20T10:00:00Z"}).encode()
    record = {"id": i, "customer": f"c{i % 97}", "amount": round(i * 0.25, 2), "note": "x" * 40}
    return serialize(record) if kind == "avro" else json.dumps(record).encode()


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(share * (len(ordered) - 1))))]


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def listed(services, path: str, key: str) -> list[dict]:
    """Every item of a paged REST listing (``path`` without limit/offset)."""
    items, offset = [], 0
    while True:
        page = services.api("GET", f"{path}{'&' if '?' in path else '?'}limit=100&offset={offset}")
        items += page[key]
        offset += len(page[key])
        if not page[key] or offset >= page["total_entries"]:
            return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", type=int, default=100)
    parser.add_argument("--interval-minutes", type=int, default=10)
    parser.add_argument("--slots", type=int, default=2, help="the pool's slots: ingest tasks on the Connect server at once")
    parser.add_argument("--records", type=int, default=100, help="records per pipeline and interval")
    parser.add_argument("--parallelism", type=int, default=8, help="AIRFLOW__CORE__PARALLELISM: tasks running at once")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oncemore-fleet-"))
    broker, registry = kafkabroker.start_kafka(), start_registry()
    connect = start_connect_server("local[2]", log_dir=str(work / "connect"))
    memory = Tree(connect.process)
    services = None
    try:
        serializer = AvroSerializer(SchemaRegistryClient(registry.settings()), json.dumps(AVRO_SCHEMA))
        kinds = ["flat", "nested", "avro"]
        formats = {"flat": FLAT, "nested": NESTED, "avro": {"type": "avro", "schema_registry": registry.settings()}}
        interval = timedelta(minutes=args.interval_minutes)
        now = datetime.now(timezone.utc)
        start = datetime.fromtimestamp(now.timestamp() // interval.total_seconds() * interval.total_seconds(), timezone.utc)
        if start + interval - now < timedelta(minutes=2):  # the DAG processor parses 100 files first
            start += interval
        pipelines_dir = work / "pipelines"
        pipelines_dir.mkdir()
        fleet = []
        for n in range(args.pipelines):
            kind, partitions, name = kinds[n % len(kinds)], 1 + n % 12, f"p{n:03d}"
            broker.create_topic(name, partitions)
            (pipelines_dir / f"{name}.yaml").write_text(yaml.safe_dump({
                "name": name, "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": name},
                "sink": {"table_uri": str(work / "delta" / name), "quarantine_uri": str(work / "delta" / f"{name}_q")},
                "format": formats[kind],
                "airflow": {"schedule": f"*/{args.interval_minutes} * * * *", "start_date": start.isoformat(),
                            "retries": 0, "pool": POOL, "spark_connect_conn_id": "oncemore_connect",
                            "tags": [kind, f"{partitions}-partitions"]},
            }))
            fleet.append((name, kind, partitions))

        def produce(round_: int, stamp: datetime) -> dict[str, list[tuple[int, int]]]:
            delivered = {}
            for name, kind, partitions in fleet:
                serialize = lambda record, topic=name: serializer(record, SerializationContext(topic, MessageField.VALUE))
                delivered[name] = broker.produce(name, [
                    (i % partitions, None, value_of(kind, round_ * args.records + i, serialize), int(stamp.timestamp() * 1000))
                    for i in range(args.records)])
            return delivered

        # The DAG folder as every DAG processor pass reads it.
        env = {"ONCEMORE_PIPELINES_DIR": str(pipelines_dir), "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               "AIRFLOW_CONN_ONCEMORE_CONNECT": json.dumps({"conn_type": "spark_connect", "host": "127.0.0.1",
                                                            "port": connect.port}),
               "AIRFLOW__CORE__PARALLELISM": str(args.parallelism)}
        sys.path.insert(0, str(ROOT / "plugins"))
        from oncemore_airflow import embedded

        os.environ.update({**embedded.settings(str(work / "parse")), **env})
        from airflow.dag_processing.dagbag import DagBag

        began = time.perf_counter()
        bag = DagBag(dag_folder=str(ROOT / "dags"))
        parse_seconds = time.perf_counter() - began
        assert len(bag.dags) == args.pipelines and not bag.import_errors, bag.import_errors

        produced = produce(0, start + interval / 2)
        services = start_airflow(work / "airflow", env)
        services.api("POST", "/api/v2/pools", {"name": POOL, "slots": args.slots,
                                               "description": "ingest tasks on the Connect server"})
        print(f"{args.pipelines} pipelines ({', '.join(kinds)}; 1 to 12 partitions), intervals of "
              f"{args.interval_minutes} min from {start:%H:%M}, pool of {args.slots} slots, parallelism "
              f"{args.parallelism}; waiting for two intervals ...", flush=True)
        while datetime.now(timezone.utc) < start + interval:
            time.sleep(5)
        for name, pairs in produce(1, start + interval + interval / 2).items():
            produced[name] += pairs
        wanted = 2 * args.pipelines

        def finished():
            runs = listed(services, "/api/v2/dags/~/dagRuns?order_by=logical_date", "dag_runs")
            failed = [f"{r['dag_id']} {r['dag_run_id']}" for r in runs if r["state"] == "failed"]
            if failed:
                raise SystemExit(f"failed runs: {failed}")
            done = [r for r in runs if r["state"] == "success"]
            return len(done) >= wanted and done

        runs = wait_for(finished, 2 * interval.total_seconds() + 3600, f"{wanted} successful runs", 10)
        tasks = listed(services, "/api/v2/dags/~/dagRuns/~/taskInstances", "task_instances")
    finally:
        if services is not None:
            services.stop()
        peak = memory.peak
        connect.stop()
        registry.stop()
        broker.stop()

    plan_start = {(t["dag_id"], t["dag_run_id"]): parse(t["start_date"]) for t in tasks if t["task_id"] == "plan"}
    delays = [(plan_start[(r["dag_id"], r["dag_run_id"])] - parse(r["data_interval_end"])).total_seconds() for r in runs]
    walls = [(parse(r["end_date"]) - parse(r["start_date"])).total_seconds() for r in runs]
    totals = {}
    for r in runs:
        end = parse(r["data_interval_end"])
        totals[end] = max(totals.get(end, 0.0), (parse(r["end_date"]) - end).total_seconds())
    inexact = []
    for name, pairs in produced.items():
        table = DeltaTable(str(work / "delta" / name)).to_pyarrow_table(columns=["_kafka_partition", "_kafka_offset"])
        found = sorted(zip(table.column("_kafka_partition").to_pylist(), table.column("_kafka_offset").to_pylist()))
        quarantined = DeltaTable(str(work / "delta" / f"{name}_q")).to_pyarrow_table().num_rows \
            if (work / "delta" / f"{name}_q" / "_delta_log").exists() else 0
        if found != sorted(pairs) or quarantined:
            inexact.append(f"{name}: {len(found)} rows for {len(pairs)} records, {quarantined} quarantined")

    print(f"DAG folder parse ({args.pipelines} pipelines, in one process): {parse_seconds:.2f} s")
    print(f"scheduler delay, interval end to plan task start: median {statistics.median(delays):.1f} s, "
          f"p95 {percentile(delays, 0.95):.1f} s, max {max(delays):.1f} s")
    print(f"run wall time (plan, ingest, report): median {statistics.median(walls):.1f} s, "
          f"p95 {percentile(walls, 0.95):.1f} s")
    for end, seconds in sorted(totals.items()):
        print(f"interval ending {end:%H:%M}: its last run ended {seconds:.0f} s after it")
    print(f"Spark Connect server peak memory (process tree): {peak / 2**20:,.0f} MiB")
    print(f"tables exact, counted by (partition, offset): {args.pipelines - len(inexact)} of {args.pipelines}")
    shutil.rmtree(work, ignore_errors=True)
    if inexact:
        raise SystemExit("not exact: " + "; ".join(inexact))


if __name__ == "__main__":
    main()
