"""Registration's promises, on the test Hive Metastore and tables made directly with delta-rs (no
Spark): idempotent, every table named (an upsert's tombstones table too), conflicts refused in one
line naming both sides, a catalog that does not answer failing the run after its commit (exit 1,
one line) while a later no-op run registers, and status and check saying where things stand.
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from conftest import oncemore
from devtools.kafkabroker import free_port
from oncemore.catalog.entries import Entry
from oncemore.catalog.hive import HiveMetastore
from oncemore.catalog.registration import catalog_state, register
from oncemore.core.errors import CatalogConflict, CatalogError
from oncemore.ops.check import check_pipeline
from oncemore.report.status import format_status, status

SCHEMA = pa.schema([("id", pa.int64()), ("customer", pa.string()), ("_kafka_offset", pa.int64())])


def catalog(metastore, table: str = "orders", database: str | None = None) -> dict:
    return {"type": "hive", "uri": metastore if isinstance(metastore, str) else metastore.uri,
            "database": database or f"bronze_{uuid.uuid4().hex[:8]}", "table": table}


def create_tables(*uris: str) -> None:
    for uri in uris:
        DeltaTable.create(uri, SCHEMA)


def test_every_table_is_registered_once_and_a_second_registration_writes_nothing(make_pipeline, topic, hive_metastore):
    pipeline = make_pipeline(topic, sink={"catalog": catalog(hive_metastore)},
                             upsert={"keys": ["id"], "sequence_by": "id"})
    database = pipeline.sink.catalog.database
    assert catalog_state(pipeline)["reason"].startswith("no table yet")
    create_tables(pipeline.sink.table_uri, pipeline.sink.quarantine_uri, pipeline.sink.tombstones_uri)
    assert not catalog_state(pipeline)["registered"]

    done = register(pipeline)
    assert [line.split(" at ")[0] for line in done] == [
        f"registered {database}.orders", f"registered {database}.orders_quarantine", f"registered {database}.orders_tombstones"]
    assert register(pipeline) == []  # as registered: nothing written
    state = catalog_state(pipeline)
    assert state["registered"] and list(state["tables"]) == [f"{database}.orders", f"{database}.orders_quarantine",
                                                              f"{database}.orders_tombstones"]

    # The table gains a column: the catalog's columns follow, once.
    write_deltalake(pipeline.sink.table_uri, pa.table({"id": [1], "customer": ["a"], "_kafka_offset": [0],
                                                       "note": ["n"]}), mode="append", schema_mode="merge")
    assert catalog_state(pipeline)["reason"] == (f"{database}.orders is registered with other columns than the "
                                                 "table's (the next run registers it)")
    assert register(pipeline) == [f"updated {database}.orders's columns (4)"]
    with HiveMetastore(hive_metastore.uri) as client:
        assert client.get(database, "orders").columns == (("id", "bigint"), ("customer", "string"),
                                                           ("_kafka_offset", "bigint"), ("note", "string"))
    assert register(pipeline) == []


def test_a_name_at_another_location_and_a_location_under_another_name_are_refused_naming_both(
        make_pipeline, topic, hive_metastore, tmp_path):
    config = catalog(hive_metastore)
    pipeline = make_pipeline(topic, sink={"catalog": config})
    database = config["database"]
    create_tables(pipeline.sink.table_uri, pipeline.sink.quarantine_uri)
    elsewhere = f"file:{tmp_path}/elsewhere"
    with HiveMetastore(hive_metastore.uri) as client:
        client.create_database(database)
        client.create(Entry("table", database, "orders", elsewhere, (("id", "bigint"),)), "someone_else")

    with pytest.raises(CatalogConflict) as refused:
        register(pipeline)
    message = str(refused.value)
    assert "\n" not in message and f"{database}.orders is registered at {elsewhere}" in message
    assert f"not at the table's location file:{pipeline.sink.table_uri}" in message
    state = catalog_state(pipeline)
    assert state["blocked"] and state["summary"] == f"catalog: not registered ({message})"
    with HiveMetastore(hive_metastore.uri) as client:  # nothing was re-pointed, nor the quarantine table registered
        assert client.get(database, "orders").location == elsewhere
        assert client.get(database, "orders_quarantine") is None

    # The same tables under another name: their locations are registered already.
    registered = make_pipeline(topic, name="orders", sink={"catalog": {**config, "table": "orders_v1"}})
    register(registered)
    renamed = make_pipeline(topic, name="orders", sink={"catalog": {**config, "table": "orders_v2"}})
    with pytest.raises(CatalogConflict) as refused:
        register(renamed)
    assert str(refused.value).startswith(
        f"pipeline orders: catalog hive {hive_metastore.uri}: the table's location file:{pipeline.sink.table_uri} is "
        f"registered as {database}.orders_v1: refusing to register it again as {database}.orders_v2")
    checks = {c.what: c for c in check_pipeline(renamed, lambda: None)}
    assert not checks["catalog"].ok and "registered as" in checks["catalog"].problem


def test_a_catalog_that_does_not_answer_fails_the_run_after_it_and_a_later_no_op_run_registers(
        make_pipeline, topic, hive_metastore):
    down = f"thrift://127.0.0.1:{free_port()}"  # nothing listens there
    pipeline = make_pipeline(topic, sink={"catalog": catalog(down)})
    before = {c.what: c for c in check_pipeline(pipeline, lambda: None)}["catalog"]  # asked before any table exists
    assert not before.ok and before.problem.startswith("the catalog did not answer: TTransportException")
    create_tables(pipeline.sink.table_uri, pipeline.sink.quarantine_uri)

    failed = oncemore("run", "--config", pipeline.origin, check_no_spark=True)
    assert failed.returncode == 1
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith("oncemore: error: orders: no-op (nothing new to ingest)")
    assert f"but the tables are not registered: pipeline orders: catalog hive {down}: registering the tables failed: " \
           "TTransportException: Could not connect" in line and line.endswith("; the next run registers them")
    shown = oncemore("status", "--config", pipeline.origin)
    assert shown.returncode == 0 and "catalog: not registered (the catalog did not answer: TTransportException" in shown.stdout
    checks = {c.what: c for c in check_pipeline(pipeline, lambda: None)}
    assert not checks["catalog"].ok and checks["catalog"].problem.startswith("the catalog did not answer")

    live = make_pipeline(topic, sink={"catalog": {**catalog(hive_metastore), "database": pipeline.sink.catalog.database}})
    checks = {c.what: c for c in check_pipeline(live, lambda: None)}
    assert checks["catalog"].ok and "answers; " in checks["catalog"].detail and "is not in the catalog" in checks["catalog"].detail
    rerun = oncemore("run", "--config", live.origin, check_no_spark=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "no-op" in rerun.stdout and "registered" in rerun.stderr
    database = live.sink.catalog.database
    text = format_status(status(live))
    assert f"catalog: registered as {database}.orders, {database}.orders_quarantine (hive {hive_metastore.uri})" in text
    assert {c.what: c for c in check_pipeline(live, lambda: None)}["catalog"].ok


def test_a_glue_catalog_that_does_not_answer_is_named_without_any_credential(make_pipeline, topic, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-to-be-shown-anywhere")
    pipeline = make_pipeline(topic, sink={"catalog": {"type": "glue", "database": "bronze", "table": "orders"}})
    create_tables(pipeline.sink.table_uri)
    with pytest.raises(CatalogError) as failed:
        register(pipeline)
    assert str(failed.value).startswith("pipeline orders: catalog glue: registering the tables failed: ")
    assert "not-to-be-shown-anywhere" not in str(failed.value) and "\n" not in str(failed.value)
