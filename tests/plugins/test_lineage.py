"""OpenLineage of the ingest task, read back from the provider's file transport and checked against
the tables themselves: rows counted by DuckDB's Delta reader, bytes and files from the Delta log's
add actions, ranges from the table's txn positions, versions from its log.

The DAG runs as a user runs one by hand, `airflow dags test` in its own process: the provider reads
its transport (AIRFLOW__OPENLINEAGE__TRANSPORT) when Airflow starts, so the other Airflow tests of
this session emit nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable
from openlineage.client.facet_v2 import symlinks_dataset
from test_airflow import HOUR, T0, airflow_db, airflow_migrated, airflow_section  # noqa: F401 (fixtures)

from conftest import ROOT, held_positions, hive_table, order, query, read_pairs
from oncemore_airflow.factory import dag_id

pytestmark = [pytest.mark.airflow, pytest.mark.spark]
BAD = [b"{not json", b"[1, 2", b"\xff\xfe"]  # quarantined: not a JSON object


def dags_test(pipeline, logical_date, events: Path, conf: dict | None = None) -> subprocess.CompletedProcess:
    """`airflow dags test` of the pipeline's DAG, its OpenLineage events written to ``events``."""
    env = {**os.environ, "ONCEMORE_PIPELINES_DIR": str(Path(pipeline.origin).parent),
           "AIRFLOW__OPENLINEAGE__NAMESPACE": "oncemore-tests",
           "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(events), "append": True})}
    done = subprocess.run([sys.executable, "-m", "airflow", "dags", "test", "-c", json.dumps(conf or {"until": "latest"}),
                           dag_id(pipeline.name), logical_date.isoformat()],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert re.search(r"DagRun Finished: .* state=success", done.stdout + done.stderr), done.stdout[-3000:] + done.stderr[-3000:]
    return done


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def task_event(events: list[dict], task_id: str, event_type: str) -> dict:
    (found,) = [e for e in events if e["job"]["name"].endswith(f".{task_id}") and e["eventType"] == event_type]
    return found


def outputs_by_name(event: dict) -> dict[str, dict]:
    return {o["name"]: o for o in event["outputs"]}


def table_files(uri: str) -> tuple[int, int]:
    """(bytes, files) of the table's snapshot, from its Delta log's add actions."""
    sizes = DeltaTable(uri).get_add_actions(flatten=True).column("size_bytes").to_pylist()
    return sum(sizes), len(sizes)


def test_the_ingest_task_reports_topic_in_tables_out_and_exactly_what_it_committed(
        airflow_db, broker, topic, make_pipeline, tmp_path):  # noqa: F811
    good = [(i % 3, str(i).encode(), order(i), None) for i in range(300)]
    broker.produce(topic, good + [(i, b"bad", BAD[i], None) for i in range(3)])
    pipeline = make_pipeline(topic, name=topic, airflow=airflow_section())  # a DAG and Asset of its own in the DB
    main, quarantine = str(Path(pipeline.sink.table_uri).resolve()), str(Path(pipeline.sink.quarantine_uri).resolve())
    host, port = broker.bootstrap_servers.split(",")[0].rsplit(":", 1)

    dags_test(pipeline, T0 + HOUR, tmp_path / "run.jsonl")

    events = read_events(tmp_path / "run.jsonl")
    complete = task_event(events, "ingest", "COMPLETE")
    assert complete["job"]["namespace"] == "oncemore-tests"
    assert complete["inputs"] == [{"namespace": f"kafka://{host}:{port}", "name": topic, "facets": {},
                                   "inputFacets": {}}]
    outputs = outputs_by_name(complete)
    assert sorted(outputs) == sorted([main, quarantine]) and {o["namespace"] for o in outputs.values()} == {"file"}
    for uri, rows in ((main, 300), (quarantine, 3)):
        counted = query(uri, "SELECT count(*) FROM {table}")[0][0]
        size, files = table_files(uri)
        assert counted == rows, f"{uri}: the produced records are in the table"
        assert outputs[uri]["outputFacets"]["outputStatistics"] | {"_producer": None, "_schemaURL": None} == {
            "rowCount": counted, "size": size, "fileCount": files, "_producer": None, "_schemaURL": None}
        columns = [name for name, *_ in query(uri, "DESCRIBE SELECT * FROM {table}")]
        assert [f["name"] for f in outputs[uri]["facets"]["schema"]["fields"]] == columns
        assert outputs[uri]["facets"]["version"]["datasetVersion"] == str(DeltaTable(uri).version())
        assert outputs[uri]["facets"]["storage"]["storageLayer"] == "delta"
    types = {f["name"]: f["type"] for f in outputs[main]["facets"]["schema"]["fields"]}
    assert types["id"] == "long" and types["customer"] == "string" and types["amount"] == "double"

    facet = complete["run"]["facets"]["oncemore"]
    positions = held_positions(main, pipeline.name, topic)
    assert facet["committed"] == {topic: {str(p): [0, end] for p, end in positions.items()}}
    assert held_positions(quarantine, pipeline.name, topic) == positions
    assert facet["status"] == "committed" and facet["pipeline"] == pipeline.name
    assert facet["tableVersion"] == DeltaTable(main).version()
    assert facet["quarantineTableVersion"] == DeltaTable(quarantine).version()
    assert [v for b in facet["batches"] for v in b["versions"]] == [DeltaTable(main).version()]
    assert facet["runId"] == json.loads(DeltaTable(main).history(1)[0]["oncemore"])["run_id"]
    start = task_event(events, "ingest", "START")
    assert start["inputs"] == complete["inputs"] and sorted(outputs_by_name(start)) == sorted(outputs)
    assert all(not o["outputFacets"] for o in start["outputs"])

    # Rerun of finished work: the ingest task skips itself, its COMPLETE event has no statistics.
    versions = DeltaTable(main).version(), DeltaTable(quarantine).version()
    dags_test(pipeline, T0 + 2 * HOUR, tmp_path / "rerun.jsonl")

    rerun = read_events(tmp_path / "rerun.jsonl")
    complete = task_event(rerun, "ingest", "COMPLETE")
    (dag_run,) = [e for e in rerun if e["job"]["name"] == dag_id(pipeline.name)]
    assert dag_run["run"]["facets"]["airflowState"]["tasksState"] == {"plan": "success", "ingest": "skipped",
                                                                     "report": "success"}
    assert complete["inputs"][0]["name"] == topic and sorted(outputs_by_name(complete)) == sorted(outputs)
    assert all("outputStatistics" not in o["outputFacets"] for o in complete["outputs"])
    facet = complete["run"]["facets"]["oncemore"]
    assert facet["status"] == "no-op" and facet["committed"] == {} and facet["batches"] == []
    assert (facet["tableVersion"], facet["quarantineTableVersion"]) == versions
    assert (DeltaTable(main).version(), DeltaTable(quarantine).version()) == versions


def test_lineage_that_cannot_be_emitted_fails_nothing_and_loses_no_record(
        airflow_db, broker, topic, make_pipeline, tmp_path):  # noqa: F811
    produced = broker.produce(topic, [(i % 3, None, order(i), None) for i in range(90)])
    pipeline = make_pipeline(topic, name=topic, airflow=airflow_section())

    # The transport's file lies in a directory that does not exist: every emit fails.
    done = dags_test(pipeline, T0 + HOUR, tmp_path / "missing" / "events.jsonl")

    assert not (tmp_path / "missing").exists()
    assert "Failed to emit OpenLineage `COMPLETE` event" in done.stdout + done.stderr
    assert sorted(read_pairs(pipeline.sink.table_uri)) == sorted(produced)
    assert held_positions(pipeline.sink.table_uri, pipeline.name, topic) == {0: 30, 1: 30, 2: 30}


def test_topics_and_tables_are_named_by_the_openlineage_naming_spec():
    from oncemore_airflow.lineage import table_dataset, topic_dataset

    def kafka(servers):
        named = topic_dataset(servers, "orders")
        return named.get_namespace(), named.get_name()

    assert kafka("b1:9093,b2:9093") == ("kafka://b1:9093", "orders")
    # A listener prefix and credentials are never part of a name; a missing port is Kafka's default.
    assert kafka("SASL_SSL://svc:s3cret@b1.example.com:9094") == ("kafka://b1.example.com:9094", "orders")
    assert kafka("broker") == ("kafka://broker:9092", "orders")
    assert kafka("[::1]:9092") == ("kafka://[::1]:9092", "orders")

    assert table_dataset("s3://lake/delta/orders") == ("s3://lake", "delta/orders")
    assert table_dataset("s3a://lake/delta/orders") == ("s3://lake", "delta/orders")
    assert table_dataset("gs://lake/orders") == ("gs://lake", "orders")
    assert table_dataset("abfss://data@acct.dfs.core.windows.net/orders") == (
        "abfss://data@acct.dfs.core.windows.net", "orders")
    assert table_dataset("file:///data/orders") == ("file", "/data/orders")
    assert table_dataset("relative/orders") == ("file", str(Path("relative/orders").resolve()))


def test_a_schema_facet_nests_structs_arrays_and_maps_as_the_delta_log_has_them(tmp_path):
    import pyarrow as pa
    from deltalake import write_deltalake

    from oncemore_airflow.lineage import table_state

    uri = str(tmp_path / "nested")
    schema = pa.schema([("id", pa.int64()), ("address", pa.struct([("city", pa.string()), ("zip", pa.string())])),
                        ("items", pa.list_(pa.string())), ("tags", pa.map_(pa.string(), pa.int32()))])
    for i in range(2):  # versions 0 and 1
        write_deltalake(uri, pa.table({"id": [i], "address": [{"city": "x", "zip": None}], "items": [["a"]],
                                       "tags": [[("a", i)]]}, schema=schema), mode="append")

    state = table_state(uri, None, 0)

    assert state.version == 0, "the version asked for, not the newest"
    assert [attr_dict(f) for f in state.fields] == [
        {"name": "id", "type": "long", "fields": []},
        {"name": "address", "type": "struct", "fields": [{"name": "city", "type": "string", "fields": []},
                                                          {"name": "zip", "type": "string", "fields": []}]},
        {"name": "items", "type": "array", "fields": [{"name": "_element", "type": "string", "fields": []}]},
        {"name": "tags", "type": "map", "fields": [{"name": "key", "type": "string", "fields": []},
                                                   {"name": "value", "type": "integer", "fields": []}]}]
    assert table_state(str(tmp_path / "none"), None, None).version is None


def attr_dict(field) -> dict:
    """A schema field as the event's JSON has it (the fields OpenLineage's serializer keeps)."""
    return {"name": field.name, "type": field.type, "fields": [attr_dict(f) for f in field.fields]}


def test_a_routed_pipeline_has_an_output_per_route_table_with_what_the_run_added_to_it(
        broker, topic, make_pipeline, spark, tmp_path):
    from oncemore.plan.planner import plan_run
    from oncemore.run import runner
    from oncemore_airflow.lineage import catalog_symlinks, run_lineage

    kinds = ("created", "paid", "refunded")  # refunded: no route, quarantined
    broker.produce(topic, [(i % 3, None, json.dumps({"id": i, "type": kinds[i % 3]}).encode(), None) for i in range(90)])
    uris = {name: str((tmp_path / name).resolve()) for name in (*kinds[:2], "quarantine")}
    pipeline = make_pipeline(topic, name="events", format=None, sink={"table_uri": None, "quarantine_uri": uris["quarantine"]},
                             routes={"by": "value.type", "tables": {
                                 v: {"table_uri": uris[v], "format": {"type": "json", "schema": "id BIGINT, type STRING"}}
                                 for v in kinds[:2]}})
    plan = plan_run(pipeline)

    report = runner.run(pipeline, plan=plan, spark_factory=lambda: spark)
    lineage = run_lineage(pipeline, plan, report.run_id, report)

    outputs = {o.name: o for o in lineage.outputs}
    assert sorted(outputs) == sorted(uris.values())
    for uri in uris.values():
        size, files = table_files(uri)
        statistics = outputs[uri].outputFacets["outputStatistics"]
        assert (statistics.rowCount, statistics.size, statistics.fileCount) == (30, size, files)
        assert outputs[uri].facets["version"].datasetVersion == str(DeltaTable(uri).version())
    facet = lineage.run_facets["oncemore"]
    assert facet.tableVersion is None and facet.quarantineTableVersion == DeltaTable(uris["quarantine"]).version()
    assert facet.routeTableVersions == {v: DeltaTable(uris[v]).version() for v in kinds[:2]}
    assert [b["tableVersions"] for b in facet.batches if b["written"]] == [
        {"created": DeltaTable(uris["created"]).version(), "paid": DeltaTable(uris["paid"]).version(),
         "quarantine": DeltaTable(uris["quarantine"]).version()}]
    hive = catalog_symlinks(type("C", (), {"type": "hive", "uri": "thrift://h:9083", "database": "d", "table": "events"}),
                            ("created", "paid"))
    assert {role: i.name for role, i in hive.items()} == {
        "route:created": "d.events_created", "route:paid": "d.events_paid", "quarantine": "d.events_quarantine"}


def test_a_catalog_name_is_a_symlink_by_the_naming_spec(s3_server, monkeypatch):
    from types import SimpleNamespace

    from oncemore_airflow.lineage import catalog_symlinks

    hive = SimpleNamespace(type="hive", uri="thrift://metastore.example.com:9083", database="sales", table="orders")
    assert catalog_symlinks(hive) == {
        "main": symlinks_dataset.Identifier("hive://metastore.example.com:9083", "sales.orders", "TABLE"),
        "quarantine": symlinks_dataset.Identifier("hive://metastore.example.com:9083", "sales.orders_quarantine", "TABLE")}

    # Glue's: the region and account of AWS's environment (here moto's server, whose account is 123456789012).
    options = s3_server.storage_options()
    for key in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, options[key])
    glue = SimpleNamespace(type="glue", database="sales", table="orders")
    assert catalog_symlinks(glue)["main"] == symlinks_dataset.Identifier(
        f"arn:aws:glue:{options['AWS_REGION']}:123456789012", "table/sales/orders", "TABLE")


def test_the_tables_registered_in_a_hive_metastore_carry_their_catalog_names(
        airflow_db, broker, topic, make_pipeline, tmp_path, hive_metastore):  # noqa: F811
    broker.produce(topic, [(i % 3, None, order(i), None) for i in range(30)] + [(1, b"bad", BAD[0], None)])
    database = f"bronze_{topic.lower()}"
    pipeline = make_pipeline(topic, name=topic, airflow=airflow_section(),
                             sink={"catalog": {"type": "hive", "uri": hive_metastore.uri, "database": database,
                                               "table": "orders"}})

    dags_test(pipeline, T0 + HOUR, tmp_path / "run.jsonl")

    outputs = outputs_by_name(task_event(read_events(tmp_path / "run.jsonl"), "ingest", "COMPLETE"))
    for uri, name in ((pipeline.sink.table_uri, "orders"), (pipeline.sink.quarantine_uri, "orders_quarantine")):
        registered = hive_table(hive_metastore, database, name)
        assert registered.sd.location.rstrip("/").endswith(str(Path(uri).resolve())), "the metastore holds it there"
        assert outputs[str(Path(uri).resolve())]["facets"]["symlinks"]["identifiers"] == [
            {"namespace": f"hive://127.0.0.1:{hive_metastore.port}", "name": f"{database}.{name}", "type": "TABLE"}]


def test_lineage_that_cannot_be_gathered_is_a_warning_and_the_task_returns_its_report(
        make_pipeline, tmp_path, monkeypatch, capsys):
    from oncemore.core.coordinates import KafkaPartition
    from oncemore.plan.planner import Plan
    from oncemore.run.runreport import BatchReport, RunReport
    from oncemore_airflow.operators import OncemoreIngestOperator

    monkeypatch.setenv("AIRFLOW__OPENLINEAGE__TRANSPORT", json.dumps({"type": "console"}))
    pipeline = make_pipeline("t", airflow=airflow_section())
    log = Path(pipeline.sink.table_uri, "_delta_log")
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("{not a delta log")  # the table cannot be read back
    plan = Plan(pipeline.name, ("t",), pipeline.sink.table_uri, "latest", ())
    report = RunReport(pipeline.name, "manual__1", plan, [BatchReport(0, {KafkaPartition("t", 0): (0, 5)}, "committed",
                                                                      5, versions=[0])])
    task = OncemoreIngestOperator(task_id="ingest", config_path=pipeline.origin)

    returned = task.landed(plan, "manual__1", report)

    assert returned == json.loads(report.to_json())
    assert task.get_openlineage_facets_on_complete(None) is None, "the provider then sends the event without it"
    assert f"pipeline {pipeline.name}: run manual__1: its lineage could not be gathered" in capsys.readouterr().out
