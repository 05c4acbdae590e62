"""The embedded default end to end: a local Apache Kafka broker, sample orders, `oncemore run` twice
(the second is a no-op), the table's row count and positions, all of the orders example
(include/pipelines/examples/orders.yaml, the examples directory being the demo's pipelines directory); Avro orders through a local schema
registry, Apicurio Registry (include/pipelines/examples/avro.yaml); Debezium change events applied by key
(include/pipelines/examples/debezium_accounts.yaml); then the pipeline's Airflow DAG on SQLite
(dag.test): a run after more data arrived, and a rerun that is a no-op."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

from deltalake import DeltaTable

from devtools import kafkabroker
from oncemore.config.loading import load_named, load_pipeline

ROOT = Path(__file__).resolve().parents[1]
# The demo's pipelines directory: its orders pipeline (and its DAG) and the other examples. The
# shipped pipelines directory, include/pipelines/, holds none: it is a user's.
EXAMPLES = ROOT / "include" / "pipelines" / "examples"


def sample_orders(count: int):
    for i in range(count):
        value = b"{not json" if i % 2_500 == 7 else json.dumps(
            {"id": i, "customer": f"customer-{i % 311}", "amount": round(10 + i % 977 * 0.5, 2)}).encode()
        yield i % 3, str(i).encode(), value, None


def oncemore(*args: str) -> None:
    print(f"\n$ oncemore {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "oncemore.cli", *args], check=True)


def main() -> None:
    data_dir = os.environ.setdefault("ONCEMORE_DATA_DIR", tempfile.mkdtemp(prefix="oncemore-demo-"))
    os.environ.setdefault("ONCEMORE_SPARK_MASTER", "local[2]")
    os.environ["ONCEMORE_PIPELINES_DIR"] = str(EXAMPLES)
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        os.environ["KAFKA_BOOTSTRAP"] = broker.bootstrap_servers
        broker.create_topic("orders", 3)
        produced = broker.produce("orders", sample_orders(20_000))
        print(f"local Apache Kafka broker at {broker.bootstrap_servers}: produced {len(produced)} records to topic "
              f"orders (3 partitions, 8 of them malformed); pipelines in {EXAMPLES.relative_to(ROOT)}; Delta tables "
              f"under {data_dir}", flush=True)

        oncemore("plan", "orders")
        oncemore("run", "orders")
        oncemore("run", "orders")  # nothing new: a no-op, no Spark
        oncemore("status", "orders")

        pipeline = load_named("orders")
        main_rows = DeltaTable(pipeline.sink.table_uri).count()
        quarantined = DeltaTable(pipeline.sink.quarantine_uri).count()
        print(f"\n{pipeline.sink.table_uri}: {main_rows} rows; quarantine: {quarantined} rows; "
              f"together {main_rows + quarantined} of {len(produced)} produced")

        avro_orders(broker)
        debezium_accounts(broker)

        more = broker.produce("orders", sample_orders(5_000))
        print(f"\nAirflow (SQLite, dag.test): {len(more)} more records produced; running DAG oncemore__orders", flush=True)
        run_dag_twice(pipeline.sink.table_uri)


AVRO_ORDER = {"type": "record", "name": "Order", "namespace": "demo", "fields": [
    {"name": "id", "type": "long"},
    {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [
        {"name": "name", "type": "string"}, {"name": "city", "type": ["null", "string"], "default": None}]}},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}},
    {"name": "placed", "type": {"type": "long", "logicalType": "timestamp-micros"}}]}


def avro_orders(broker) -> None:
    """The Avro example: records in Confluent's wire format, their schema in a local Apicurio Registry."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from devtools.schemaregistry import start_registry

    registry = start_registry()
    try:
        os.environ["SCHEMA_REGISTRY_URL"] = registry.url
        broker.create_topic("orders_avro", 2)
        serialize = AvroSerializer(SchemaRegistryClient(registry.settings()), json.dumps(AVRO_ORDER))
        context = SerializationContext("orders_avro", MessageField.VALUE)
        now = datetime.now(timezone.utc)
        records = [(i % 2, f"key-{i}".encode(), serialize({
            "id": i, "customer": {"name": f"customer-{i % 7}", "city": "Oslo" if i % 2 else None},
            "amount": Decimal(i) / 4, "placed": now}, context), None) for i in range(1_000)]
        broker.produce("orders_avro", records)
        print(f"\nlocal schema registry (Apicurio) at {registry.url}: 1000 Avro orders (nested, decimal, timestamp) "
              "to topic orders_avro", flush=True)
        example = str(EXAMPLES / "avro.yaml")
        oncemore("run", "--config", example)
        table_uri = load_pipeline(example).sink.table_uri
        table = DeltaTable(table_uri)
        columns = [f.name for f in table.schema().fields if not f.name.startswith("_kafka_")]
        print(f"{table_uri}: {table.count()} rows; columns from the registered schema: {', '.join(columns)}")
    finally:
        registry.stop()


def debezium_accounts(broker) -> None:
    """The Debezium example (include/pipelines/examples/debezium_accounts.yaml): a simulated source
    table's change events, late ones among them, land as that table's current state."""
    from devtools.changefeed import debezium_events, produce, project, source_state, table_state

    broker.create_topic("shop.public.accounts", 3)
    events = debezium_events(keys=500, changes=5_000, seed=1)
    produce(broker.bootstrap_servers, "shop.public.accounts", events, "shuffled", seed=1)
    print(f"\n{len(events)} Debezium change events of table shop.public.accounts (snapshot, creates, updates, "
          "deletes, tombstones) to topic shop.public.accounts, spread over 3 partitions out of order", flush=True)
    example = str(EXAMPLES / "debezium_accounts.yaml")
    oncemore("run", "--config", example)
    oncemore("run", "--config", example)  # nothing new: a no-op
    table_uri = load_pipeline(example).sink.table_uri
    landed = project(table_state(table_uri, ("id",)), ("id", "name", "balance"))
    expected = source_state(events)
    print(f"{table_uri}: {len(landed)} rows; the source table has {len(expected)}: "
          f"{'equal, key by key' if landed == expected else 'THEY DIFFER'}", flush=True)
    if landed != expected:
        raise SystemExit("the Debezium example's table differs from its source table's state")


def run_dag_twice(table_uri: str) -> None:
    sys.path.insert(0, str(ROOT / "plugins"))
    from oncemore_airflow import embedded

    embedded.configure(os.path.join(os.environ["ONCEMORE_DATA_DIR"], "airflow"))
    os.environ["AIRFLOW__LOGGING__LOGGING_LEVEL"] = "WARNING"
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True)
    from airflow.dag_processing.dagbag import DagBag

    # Airflow's deprecation warnings about its own dependencies are not the demo's to show (set
    # after its import, which puts filters of its own first).
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"airflow\.")

    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["oncemore__orders"]
    # A manual run up to the log end (an interval run would end at its data_interval_end).
    for label in ("run", "rerun"):
        run = dag.test(run_conf={"until": "latest"})
        tasks = {ti.task_id: ti for ti in run.get_task_instances()}
        plan = tasks["plan"]
        print(f"  {label}: DAG run {run.state}; " + ", ".join(f"{t} {ti.state}" for t, ti in tasks.items())
              + f"; plan task {(plan.end_date - plan.start_date).total_seconds():.2f}s; table version "
              f"{DeltaTable(table_uri).version()}, {DeltaTable(table_uri).count()} rows", flush=True)
        if run.state != "success":
            sys.exit(f"DAG run {label} failed")


if __name__ == "__main__":
    main()
