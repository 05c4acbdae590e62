"""Airflow: the DAG factory, and DAG runs end to end through dag.test() with a real spark-submit.

Interval runs end at the first record of their data_interval_end. What a run must hold is
computed from the DagRun's own data interval and the records' timestamps as the broker returns
them, never from a guess about how dag.test maps a logical date to an interval.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))
from oncemore_airflow import embedded  # noqa: E402

# Airflow reads its configuration at import: set it up before the first import. Each test's DAG
# (oncemore__orders at the test's own tables) is serialized anew: Airflow skips a DAG's rewrite
# within 30 s of the last one by default, and dag.test() would then run the previous test's DAG.
os.environ["AIRFLOW__CORE__MIN_SERIALIZED_DAG_UPDATE_INTERVAL"] = "0"
embedded.configure(tempfile.mkdtemp(prefix="oncemore-airflow-"))

from airflow.dag_processing.dagbag import DagBag  # noqa: E402
from confluent_kafka import Consumer, TopicPartition  # noqa: E402
from deltalake import DeltaTable  # noqa: E402

from conftest import assert_exactly_once, held_positions, order, orders, read_pairs  # noqa: E402
from oncemore_airflow.factory import build_dag, build_maintenance_dag  # noqa: E402

pytestmark = pytest.mark.airflow
HOUR = timedelta(hours=1)
T0 = datetime(2026, 11, 20, 0, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="session")
def airflow_migrated():
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True, timeout=600)


@pytest.fixture
def airflow_db(airflow_migrated):
    """Airflow's database, with no earlier test's table an active asset: an asset named
    oncemore/<pipeline> at another test's table would leave this test's inactive and fail its
    tasks (a scheduler orphans such assets; dag.test() does not)."""
    from airflow.models.asset import AssetActive
    from airflow.utils.session import create_session

    with create_session() as session:
        session.query(AssetActive).delete()


@pytest.fixture(autouse=True)
def pipelines_dir(tmp_path, monkeypatch):
    """The dags folder reads the test's own pipelines directory, where make_pipeline writes:
    dag.test() serializes the DAG the dags folder yields, and the shipped directory holds none."""
    monkeypatch.setenv("ONCEMORE_PIPELINES_DIR", str(tmp_path / "pipelines"))


def airflow_section(**overrides):
    return {"start_date": T0.isoformat(), "retries": 0, **overrides}


def states(run) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


def table_version(uri: str) -> int | None:
    return DeltaTable(uri).version() if Path(uri, "_delta_log").exists() else None


def test_the_shipped_pipelines_directory_holds_no_pipeline_so_a_new_airflow_shows_no_dag(monkeypatch):
    monkeypatch.delenv("ONCEMORE_PIPELINES_DIR", raising=False)
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert not bag.import_errors and not bag.dags
    assert not list((ROOT / "include" / "pipelines").glob("*.y*ml")), "examples belong in include/pipelines/examples/"


def test_every_example_yields_a_dag_with_plan_ingest_report(monkeypatch):
    examples = ROOT / "include" / "pipelines" / "examples"
    monkeypatch.setenv("ONCEMORE_PIPELINES_DIR", str(examples))
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert not bag.import_errors
    names = sorted(p.stem for p in examples.glob("*.yaml"))
    maintained = [n for n in names if "maintenance:" in (examples / f"{n}.yaml").read_text()]
    assert maintained, "the demo pipeline shows the maintenance block"
    assert sorted(bag.dags) == sorted([f"oncemore__{n}" for n in names] + [f"oncemore_maintain__{n}" for n in maintained])
    for name in maintained:
        maintenance = bag.dags[f"oncemore_maintain__{name}"]
        assert [t.task_id for t in maintenance.tasks] == ["maintain"] and not maintenance.catchup
    for dag in (bag.dags[f"oncemore__{n}"] for n in names):
        assert [t.task_id for t in dag.topological_sort()] == ["plan", "ingest", "report"]
        assert dag.max_active_runs == 1 and "oncemore" in dag.tags
        assert type(dag.timetable).__name__ == "CronDataIntervalTimetable"
        assert dag.tasks[1].outlets and dag.doc_md


def test_the_tasks_running_spark_take_the_pipelines_pool_and_airflow_warns_of_a_pool_not_created(make_pipeline):
    make_pipeline("t", airflow=airflow_section(pool="oncemore_spark"), maintenance={"verify": "0 5 * * *"})
    make_pipeline("t", name="unpooled", airflow=airflow_section())
    bag = DagBag(dag_folder=str(ROOT / "dags"), known_pools={"default_pool"})
    pools = {dag_id: {t.task_id: t.pool for t in bag.dags[dag_id].tasks}
             for dag_id in ("oncemore__orders", "oncemore_maintain__orders", "oncemore__unpooled")}
    assert pools == {"oncemore__orders": {"plan": "default_pool", "ingest": "oncemore_spark", "report": "default_pool"},
                     "oncemore_maintain__orders": {"maintain": "default_pool", "verify": "oncemore_spark"},
                     "oncemore__unpooled": {"plan": "default_pool", "ingest": "default_pool", "report": "default_pool"}}
    assert sorted((w.dag_id, w.message) for w in bag.dag_warnings) == [
        (dag_id, f"Dag '{dag_id}' references non-existent pools: ['oncemore_spark']")
        for dag_id in ("oncemore__orders", "oncemore_maintain__orders")]
    assert not DagBag(dag_folder=str(ROOT / "dags"), known_pools={"default_pool", "oncemore_spark"}).dag_warnings


def test_a_pipeline_with_an_end_date_schedules_no_interval_starting_after_it(make_pipeline):
    import pendulum
    from airflow.timetables.base import DataInterval, TimeRestriction

    make_pipeline("t", airflow=airflow_section(end_date=(T0 + 2 * HOUR).isoformat(), catchup=True))
    dag = DagBag(dag_folder=str(ROOT / "dags")).dags["oncemore__orders"]
    restriction = TimeRestriction(earliest=dag.start_date, latest=dag.end_date, catchup=True)

    def next_after(start):
        last = DataInterval(pendulum.instance(start), pendulum.instance(start + HOUR))
        found = dag.timetable.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)
        return found and found.data_interval.start

    assert [next_after(T0), next_after(T0 + HOUR), next_after(T0 + 2 * HOUR)] == [T0 + HOUR, T0 + 2 * HOUR, None]


def test_a_broken_config_is_an_import_error_naming_it_while_the_rest_load(tmp_path, monkeypatch):
    good = (ROOT / "include" / "pipelines" / "examples" / "orders.yaml").read_text()
    (tmp_path / "orders.yaml").write_text(good)
    (tmp_path / "payments.yaml").write_text(good.replace("name: orders", "name: payments").replace("delta/orders", "delta/payments"))
    (tmp_path / "broken.yaml").write_text(good.replace("name: orders", "name: broken").replace("topic: orders", "topic: [1, 2]"))
    # A typo inside an optional block once made the key listing crash and took every DAG down.
    (tmp_path / "typo.yaml").write_text(good.replace("name: orders", "name: typo").replace("delta/orders", "delta/typo")
                                        .replace('  schedule: "30 3 * * *"', '  schedul: "30 3 * * *"'))
    # No airflow block: a pipeline for the CLI only, which is neither a DAG nor an error.
    cli_only = yaml.safe_load(good.replace("name: orders", "name: cli_only").replace("delta/orders", "delta/cli_only"))
    del cli_only["airflow"]
    (tmp_path / "cli_only.yaml").write_text(yaml.safe_dump(cli_only))
    monkeypatch.setenv("ONCEMORE_PIPELINES_DIR", str(tmp_path))

    bag = DagBag(dag_folder=str(ROOT / "dags"))

    assert sorted(bag.dags) == ["oncemore__orders", "oncemore__payments",
                                "oncemore_maintain__orders", "oncemore_maintain__payments"]
    (error,) = bag.import_errors.values()
    assert f"{tmp_path / 'broken.yaml'}: source.topic: must be a string, got a list" in error
    assert f"{tmp_path / 'typo.yaml'}: maintenance.schedul: unknown key; did you mean maintenance.schedule?" in error
    assert "run `oncemore check`" in error and "cli_only" not in error


def test_rerun_of_an_interval_is_a_noop_that_skips_spark(airflow_db, broker, topic, make_pipeline):
    produced = broker.produce(topic, orders(0, 600))
    pipeline = make_pipeline(topic, airflow=airflow_section())
    dag = build_dag(pipeline)

    first = dag.test(logical_date=T0 + HOUR, run_conf={"until": "latest"})
    assert first.state == "success", states(first)
    assert states(first) == {"plan": "success", "ingest": "success", "report": "success"}
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    version = table_version(pipeline.sink.table_uri)

    again = build_dag(pipeline).test(logical_date=T0 + 2 * HOUR, run_conf={"until": "latest"})
    assert again.state == "success"
    assert states(again) == {"plan": "success", "ingest": "skipped", "report": "success"}
    assert table_version(pipeline.sink.table_uri) == version
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_the_ingest_task_runs_on_a_spark_connect_connection_when_the_pipeline_names_one(
        airflow_db, broker, topic, make_pipeline, connect_server, connect_session, monkeypatch):
    # connect_session: the task opens its session in this process; the fixture ends Connect mode after.
    produced = broker.produce(topic, orders(0, 600))
    monkeypatch.setenv("AIRFLOW_CONN_ONCEMORE_CONNECT", json.dumps(
        {"conn_type": "spark_connect", "host": "127.0.0.1", "port": connect_server.port}))
    # The spark-submit connection points nowhere: only the Connect server can ingest.
    monkeypatch.setenv("AIRFLOW_CONN_ONCEMORE_SPARK", '{"conn_type": "spark", "host": "spark://127.0.0.1:9"}')
    pipeline = make_pipeline(topic, airflow=airflow_section(spark_connect_conn_id="oncemore_connect"))
    dag = build_dag(pipeline)
    assert type(dag.get_task("ingest")).__name__ == "OncemoreConnectIngestOperator"

    run = dag.test(logical_date=T0 + HOUR, run_conf={"until": "latest"})

    assert states(run) == {"plan": "success", "ingest": "success", "report": "success"}
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert held_positions(pipeline.sink.table_uri, pipeline.name, topic) == {0: 200, 1: 200, 2: 200}


def test_manual_run_with_until_offsets_and_dry_run(airflow_db, broker, topic, make_pipeline):
    produced = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, airflow=airflow_section())
    by_partition = {p: sorted(o for q, o in produced if q == p) for p in (0, 1, 2)}
    until = {"0": by_partition[0][40], "2": by_partition[2][10]}

    dry = build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": str(until).replace("'", '"'), "dry_run": True})
    assert dry.state == "success"
    assert states(dry) == {"plan": "success", "ingest": "skipped", "report": "success"}
    assert table_version(pipeline.sink.table_uri) is None, "a dry run commits nothing"

    run = build_dag(pipeline).test(logical_date=T0 + 2 * HOUR, run_conf={"until": str(until).replace("'", '"')})
    assert run.state == "success", states(run)
    expected = [(0, o) for o in by_partition[0][:40]] + [(2, o) for o in by_partition[2][:10]]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), expected)
    positions = held_positions(pipeline.sink.table_uri, pipeline.name, topic)
    # Partition 1 was not named: the first commit records its start (earliest) and nothing else.
    assert positions == {0: by_partition[0][40], 1: 0, 2: by_partition[2][10]}


def test_a_batch_over_the_quarantine_limit_fails_the_ingest_task_and_accept_quarantine_commits_it(
        airflow_db, broker, topic, make_pipeline):
    produced = broker.produce(topic, [(i % 3, None, b'{"id": %d, "amount": "twelve"}' % i, None) for i in range(60)])
    pipeline = make_pipeline(topic, airflow=airflow_section())

    failed = build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": "latest"})

    assert failed.state == "failed"
    assert states(failed) == {"plan": "success", "ingest": "failed", "report": "upstream_failed"}
    assert read_pairs(pipeline.sink.table_uri) == read_pairs(pipeline.sink.quarantine_uri) == []
    assert held_positions(pipeline.sink.quarantine_uri, pipeline.name, topic) == {0: None, 1: None, 2: None}

    accepted = build_dag(pipeline).test(logical_date=T0 + 2 * HOUR,
                                        run_conf={"until": "latest", "accept_quarantine": True})
    assert accepted.state == "success", states(accepted)
    assert read_pairs(pipeline.sink.table_uri) == []
    assert_exactly_once(read_pairs(pipeline.sink.quarantine_uri), produced)


def test_invalid_until_param_is_rejected_before_anything_runs(airflow_db, topic, make_pipeline):
    pipeline = make_pipeline(topic, airflow=airflow_section())
    with pytest.raises(Exception, match="does not match"):
        build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": "next tuesday"})
    assert table_version(pipeline.sink.table_uri) is None


def test_failed_ingest_then_next_run_loses_nothing_and_duplicates_nothing(airflow_db, broker, topic, make_pipeline, monkeypatch):
    produced = broker.produce(topic, orders(0, 450))
    pipeline = make_pipeline(topic, airflow=airflow_section())
    # The Spark job fails: its master is unreachable.
    monkeypatch.setenv("AIRFLOW_CONN_ONCEMORE_SPARK", '{"conn_type": "spark", "host": "spark://127.0.0.1:9"}')
    failed = build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": "latest"})
    assert failed.state == "failed"
    assert states(failed)["ingest"] == "failed"
    assert read_pairs(pipeline.sink.table_uri) == []

    monkeypatch.setenv("AIRFLOW_CONN_ONCEMORE_SPARK", '{"conn_type": "spark", "host": "local[2]"}')
    more = broker.produce(topic, orders(450, 150))
    next_run = build_dag(pipeline).test(logical_date=T0 + 2 * HOUR, run_conf={"until": "latest"})
    assert next_run.state == "success", states(next_run)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced + more)


def produce_like_producers(broker, topic: str, hour: datetime, per_hour: int = 30) -> None:
    """Three past hours produced by an idempotent producer stamping each record with its event
    time (as a replicator or a CDC source does), then the current hour's records produced now, in
    transactions, stamped by the producer at send time."""
    for back in (3, 2, 1):
        start_ms = int((hour - back * HOUR).timestamp() * 1000)
        broker.produce(topic, [(i % 3, None, order(back * 1000 + i), start_ms + i * 90_000) for i in range(per_hour)])
    for chunk in range(2):
        broker.produce(topic, [(i % 3, None, order(10_000 + chunk * 100 + i), None) for i in range(per_hour // 2)],
                       transactional_id="current-hour")


def stamps(broker, topic: str) -> dict[tuple[int, int], int]:
    """Every committed record's (partition, offset) -> timestamp (ms), read back from the broker."""
    consumer = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": "stamps",
                         "isolation.level": "read_committed", "enable.auto.commit": False})
    admin = broker.admin()
    (metadata,) = [admin.list_topics(timeout=10).topics[topic]]
    ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in metadata.partitions}
    consumer.assign([TopicPartition(topic, p, 0) for p in ends])
    found: dict[tuple[int, int], int] = {}
    while any(consumer.position([TopicPartition(topic, p)])[0].offset < end for p, end in ends.items() if end):
        for message in consumer.consume(1000, 1.0):
            found[(message.partition(), message.offset())] = message.timestamp()[1]
    consumer.close()
    return found


def stamped_between(records: dict[tuple[int, int], int], start: datetime, end: datetime) -> list[tuple[int, int]]:
    start_ms, end_ms = int(start.timestamp() * 1000), int(end.timestamp() * 1000)
    return sorted(pair for pair, stamp in records.items() if start_ms <= stamp < end_ms)


def test_hourly_runs_ingest_exactly_their_interval(airflow_db, broker, topic, make_pipeline):
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    produce_like_producers(broker, topic, hour)
    records = stamps(broker, topic)
    # Scheduled from three hours back: the first interval's start is where the table starts.
    pipeline = make_pipeline(topic, airflow=airflow_section(start_date=(hour - 3 * HOUR).isoformat()))

    # The table starts at the start date; each run ends at its own data_interval_end.
    landed: list[tuple[int, int]] = []
    previous_end = hour - 3 * HOUR
    for logical_date in (hour - 2 * HOUR, hour - HOUR, hour, hour + HOUR):
        run = build_dag(pipeline).test(logical_date=logical_date)
        assert run.state == "success", states(run)
        assert run.data_interval_start == previous_end, "consecutive hourly runs tile the hours"
        interval = stamped_between(records, previous_end, run.data_interval_end)
        assert interval, f"[{previous_end}, {run.data_interval_end}) holds records"
        landed += interval
        assert_exactly_once(read_pairs(pipeline.sink.table_uri), landed)
        previous_end = run.data_interval_end
    assert sorted(landed) == sorted(records), "every record produced landed in its own interval"


def test_a_routed_pipeline_runs_its_interval_into_each_route_table_with_an_asset_per_table(
        airflow_db, broker, topic, make_pipeline, tmp_path):
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    for back in (2, 1):  # two past hours of events, stamped with their event time
        start_ms = int((hour - back * HOUR).timestamp() * 1000)
        broker.produce(topic, [(i % 3, None, json.dumps({"id": back * 100 + i, "type": ("created", "paid")[i % 2]}).encode(),
                                start_ms + i * 90_000) for i in range(30)])
    records = stamps(broker, topic)
    uris = {v: str(tmp_path / "delta" / f"events_{v}") for v in ("created", "paid")}
    routes = {"by": "value.type", "tables": {v: {"table_uri": uri, "format": {"type": "json", "schema": "id BIGINT, type STRING"}}
                                             for v, uri in uris.items()}}
    pipeline = make_pipeline(topic, name="events", format=None, routes=routes,
                             sink={"table_uri": None, "quarantine_uri": str(tmp_path / "delta" / "events_quarantine")},
                             airflow=airflow_section(start_date=(hour - 2 * HOUR).isoformat()))

    dag = build_dag(pipeline)
    assert [(a.name, a.uri) for a in dag.get_task("ingest").outlets] == [
        ("oncemore/events/created", f"file://{uris['created']}"), ("oncemore/events/paid", f"file://{uris['paid']}")]
    assert "routed by `value.type`" in dag.doc_md and f"route `paid` -> `{uris['paid']}`" in dag.doc_md
    run = dag.test(logical_date=hour - HOUR)
    assert run.state == "success", states(run)
    interval = stamped_between(records, hour - 2 * HOUR, run.data_interval_end)
    assert interval and len(interval) < len(records)
    assert_exactly_once(read_pairs(uris["created"]) + read_pairs(uris["paid"]), interval)


def test_backfill_in_order_ingests_each_slice_and_a_second_backfill_is_all_noops(airflow_db, broker, topic, make_pipeline):
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    produce_like_producers(broker, topic, hour)
    records = stamps(broker, topic)
    pipeline = make_pipeline(topic, source={"starting_offsets": "earliest"},
                             airflow=airflow_section(start_date=(hour - 3 * HOUR).isoformat()))
    # earliest: the first run also takes everything before its interval.
    expected, previous_end = [], datetime.min.replace(tzinfo=timezone.utc)
    for logical_date in (hour - 2 * HOUR, hour - HOUR, hour):
        run = build_dag(pipeline).test(logical_date=logical_date)
        assert run.state == "success", states(run)
        expected += stamped_between(records, previous_end, run.data_interval_end)
        assert_exactly_once(read_pairs(pipeline.sink.table_uri), expected)
        previous_end = run.data_interval_end
    version = table_version(pipeline.sink.table_uri)
    for logical_date in (hour - 2 * HOUR, hour - HOUR, hour):
        run = build_dag(pipeline).test(logical_date=logical_date)
        assert run.state == "success" and states(run)["ingest"] == "skipped", states(run)
    assert table_version(pipeline.sink.table_uri) == version
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), expected)


def test_kafka_connection_overrides_reach_the_plan_and_the_spark_job(airflow_db, broker, topic, make_pipeline, monkeypatch):
    produced = broker.produce(topic, orders(0, 300))
    # The YAML names an address nobody listens on: only the connection's host can work.
    pipeline = make_pipeline(topic, source={"bootstrap_servers": "127.0.0.1:9"},
                             airflow=airflow_section(kafka_conn_id="kafka_test"))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_TEST", json.dumps(
        {"conn_type": "kafka", "host": broker.bootstrap_servers, "extra": {"client.id": "oncemore-from-airflow"}}))

    run = build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": "latest"})

    assert run.state == "success", states(run)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    plan_xcom = next(ti for ti in run.get_task_instances() if ti.task_id == "plan").xcom_pull(task_ids="plan", key="plan")
    assert broker.bootstrap_servers not in plan_xcom and "client.id" not in plan_xcom


def test_kafka_connection_maps_hosts_sasl_and_options(make_pipeline, monkeypatch):
    pipeline = make_pipeline("t", airflow=airflow_section(kafka_conn_id="kafka_sasl"))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_SASL", json.dumps({
        "conn_type": "kafka", "host": "b1,b2:9093", "port": 9092, "login": "svc", "password": "s3cret",
        "extra": {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512"},
    }))
    from oncemore_airflow.hooks import OncemoreHook

    resolved = OncemoreHook(pipeline.origin, "kafka_sasl").get_pipeline()

    assert resolved.source.bootstrap_servers == "b1:9092,b2:9093"
    assert resolved.source.kafka_options == {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                                             "sasl.username": "svc", "sasl.password": "s3cret"}
    assert "s3cret" not in json.dumps(resolved.redacted())


def test_connection_secrets_reach_the_spark_job_in_a_private_file_never_its_command_or_conf(make_pipeline, monkeypatch):
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    from oncemore.core.coordinates import OffsetRange
    from oncemore.plan.planner import Batch, Plan
    from oncemore.run.runreport import RunReport
    from oncemore_airflow.operators import OncemoreIngestOperator

    pipeline = make_pipeline("t", airflow=airflow_section(kafka_conn_id="kafka_sasl"))
    monkeypatch.setenv("AIRFLOW_CONN_KAFKA_SASL", json.dumps(
        {"conn_type": "kafka", "host": "b1:9093", "login": "svc", "password": "s3cret-9f2", "extra": {"security.protocol": "SASL_SSL"}}))
    # On YARN (and Kubernetes) the provider turns env_vars into --conf spark.yarn.appMasterEnv.* arguments.
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_YARN", json.dumps({"conn_type": "spark", "host": "yarn"}))
    seen = {}

    def submitted(operator, context):
        args = operator.application_args
        command = SparkSubmitHook(conn_id="spark_yarn", env_vars=operator.env_vars, py_files=operator.py_files,
                                  application_args=args)._build_spark_submit_command(operator.application)
        overrides_file = Path(args[args.index("--kafka-overrides-file") + 1])
        seen.update(command=" ".join(command), mode=overrides_file.stat().st_mode & 0o777,
                    overrides=json.loads(overrides_file.read_text()))
        Path(args[args.index("--report-file") + 1]).write_text(RunReport("t", "manual__1", plan).to_json())

    monkeypatch.setattr(SparkSubmitOperator, "execute", submitted)
    plan = Plan("t", ("t",), pipeline.sink.table_uri, "latest", (Batch(0, (OffsetRange("t", 0, 0, 5),), {}),))
    ti = type("TI", (), {"xcom_pull": lambda self, task_ids, key: plan.to_json()})()
    returned = OncemoreIngestOperator(task_id="ingest", config_path=pipeline.origin, kafka_conn_id="kafka_sasl",
                                      conn_id="spark_yarn").execute({"ti": ti, "run_id": "manual__1", "params": {}})

    assert "s3cret-9f2" not in seen["command"] and "appMasterEnv" not in seen["command"]
    assert seen["mode"] == 0o600 and seen["overrides"]["kafka_options"]["sasl.password"] == "s3cret-9f2"
    assert "s3cret-9f2" not in json.dumps(returned) and "b1:9093" not in json.dumps(returned), "the task's XCom"


def test_a_run_ends_at_its_param_else_its_interval_end_else_latest():
    from oncemore.config.values import OffsetBound
    from oncemore_airflow.operators import run_until

    end_ms = int((T0 + 2 * HOUR).timestamp() * 1000)
    assert run_until(None, T0 + HOUR, T0 + 2 * HOUR) == OffsetBound("timestamp", timestamp_ms=end_ms)
    assert run_until("", T0 + HOUR, T0 + 2 * HOUR) == OffsetBound("timestamp", timestamp_ms=end_ms)
    # Manual runs: no interval, or a zero-length one (a trigger timetable's) -> the log end.
    assert run_until(None, None, None) == OffsetBound("latest")
    assert run_until(None, T0, T0) == OffsetBound("latest")
    assert run_until('{"0": 7}', T0 + HOUR, T0 + 2 * HOUR) == OffsetBound("offsets", offsets={(None, 0): 7})
    assert run_until("latest", T0 + HOUR, T0 + 2 * HOUR) == OffsetBound("latest")


def test_the_report_task_fails_when_the_run_ends_beyond_the_alert_limits(airflow_db, broker, topic, make_pipeline):
    # Stamped now: the run of an interval long past plans nothing, and ends far behind the topic.
    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, airflow=airflow_section(), alert={"max_lag_records": 50})

    run = build_dag(pipeline).test(logical_date=T0 + HOUR)

    assert run.state == "failed"
    assert states(run) == {"plan": "success", "ingest": "skipped", "report": "failed"}


def test_the_maintenance_dag_maintains_the_tables(airflow_db, broker, topic, make_pipeline):
    produced = broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, airflow=airflow_section(), maintenance={"schedule": "0 4 * * *"},
                             limits={"max_records_per_commit": 100})
    assert build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": "latest"}).state == "success"
    files = len(DeltaTable(pipeline.sink.table_uri).file_uris())

    run = build_maintenance_dag(pipeline).test(logical_date=T0 + 24 * HOUR)

    assert run.state == "success" and states(run) == {"maintain": "success"}
    assert len(DeltaTable(pipeline.sink.table_uri).file_uris()) < files
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_the_maintenance_dag_verifies_on_its_schedule_and_the_page_shows_the_last_result(
        airflow_db, broker, topic, make_pipeline):
    from deltalake import write_deltalake

    from oncemore.report.overview import pipeline_overview
    from oncemore.report.verdict import last_result
    from oncemore_airflow.operators import verify_due

    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic, airflow=airflow_section(), limits={"max_records_per_commit": 100},
                             maintenance={"schedule": "0 4 * * *", "verify": "0 4 * * 0"})
    dag = build_maintenance_dag(pipeline)
    assert [t.task_id for t in dag.tasks] == ["maintain", "verify"] and dag.get_task("maintain").downstream_task_ids == {"verify"}
    assert build_maintenance_dag(make_pipeline(topic, name="plain", airflow=airflow_section(),
                                               maintenance={"schedule": "0 4 * * *"})).task_ids == ["maintain"]
    sunday = datetime(2026, 11, 22, 4, 0, tzinfo=timezone.utc)
    assert verify_due("0 4 * * 0", sunday - 24 * HOUR, sunday) is False, "the interval ends just before Sunday 04:00"
    assert verify_due("0 4 * * 0", sunday, sunday + 24 * HOUR) is True
    assert build_dag(pipeline).test(logical_date=T0 + HOUR, run_conf={"until": "latest"}).state == "success"

    run = dag.test(logical_date=T0 + 24 * HOUR)  # by hand: verified whatever the schedule

    assert run.state == "success" and states(run) == {"maintain": "success", "verify": "success"}, states(run)
    recorded = last_result(pipeline)
    assert recorded["ok"] is True and recorded["rows"]["main"] == 300 and recorded["summary"].startswith("orders: OK")
    shown = pipeline_overview(pipeline)["verified"]
    assert shown["ok"] is True and shown["first"] is None and shown["at"] == recorded["at"]

    rows = DeltaTable(pipeline.sink.table_uri).to_pyarrow_table()
    write_deltalake(pipeline.sink.table_uri, rows.slice(0, 1), mode="append")  # a duplicate

    failed = dag.test(logical_date=T0 + 48 * HOUR)

    assert states(failed) == {"maintain": "success", "verify": "failed"}
    shown = pipeline_overview(pipeline)["verified"]
    assert shown["ok"] is False and shown["first"].startswith(f"duplicate: {topic}/"), shown


def test_a_run_with_nothing_to_ingest_registers_what_an_earlier_run_could_not(
        airflow_db, broker, topic, make_pipeline, hive_metastore):
    """An empty plan skips the ingest task before any Spark; it registers the tables first, as a
    no-op `oncemore run` does, so the next scheduled run makes good a failed registration whether
    or not new records arrived (DESIGN.md 8)."""
    from conftest import hive_table
    from devtools.kafkabroker import free_port

    database = f"bronze_{uuid.uuid4().hex[:8]}"
    catalog = {"type": "hive", "uri": f"thrift://127.0.0.1:{free_port()}", "database": database, "table": "orders"}
    produced = broker.produce(topic, orders(0, 60))
    down = make_pipeline(topic, sink={"catalog": catalog}, airflow=airflow_section())
    first = build_dag(down).test(logical_date=T0 + HOUR, run_conf={"until": "latest"})
    assert states(first) == {"plan": "success", "ingest": "failed", "report": "upstream_failed"}
    assert_exactly_once(read_pairs(down.sink.table_uri), produced)  # committed before the registration failed

    live = make_pipeline(topic, sink={"catalog": {**catalog, "uri": hive_metastore.uri}}, airflow=airflow_section())
    again = build_dag(live).test(logical_date=T0 + 2 * HOUR, run_conf={"until": "latest"})
    assert states(again) == {"plan": "success", "ingest": "skipped", "report": "success"}
    assert hive_table(hive_metastore, database, "orders").sd.location == f"file:{live.sink.table_uri}"
    assert hive_table(hive_metastore, database, "orders_quarantine").sd.location == f"file:{live.sink.quarantine_uri}"
    assert_exactly_once(read_pairs(live.sink.table_uri), produced)
