"""Catalog registration in a Hive Metastore (devtools.hivemetastore: Apache Hive's standalone server
4.0.1), tested from the reader's side: a delta-spark session whose catalog is that metastore (a
Spark Connect server with the Hive 4.0.1 client) reads the pipeline's tables by name, every row,
after schema evolution too; oncemore's runs go through the same server.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
from conftest import assert_exactly_once, hive_table, read_pairs
from devtools.kafkabroker import free_port
from oncemore.core.errors import CatalogError
from oncemore.run import runner

pytestmark = pytest.mark.spark

RICH = "id BIGINT, customer STRING, amount DECIMAL(12,2), at TIMESTAMP, tags MAP<STRING, INT>, " \
       "address STRUCT<city: STRING, zip: STRING>, items ARRAY<STRING>"


@pytest.fixture(scope="module")
def reader(hive_metastore, tmp_path_factory):
    """A delta-spark session whose catalog is the test metastore (a Connect server of its own, on one
    core): the Spark user's reads by name, and oncemore's runs."""
    from devtools.hivemetastore import reader_conf
    from devtools.sparkjars import start_delta_connect_server
    from oncemore.run.session import spark_session, stop_session

    server = start_delta_connect_server(
        "local[1]", log_dir=str(tmp_path_factory.mktemp("hive-reader")),
        conf={**reader_conf(hive_metastore.uri), "spark.sql.shuffle.partitions": "2", "spark.sql.session.timeZone": "UTC",
              "spark.sql.warehouse.dir": str(tmp_path_factory.mktemp("warehouse"))})
    session = spark_session(remote=server.url)
    yield session
    stop_session(session)
    server.stop()
    os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # the worker's other modules use a classic session


def record(i: int, evolved: bool = False) -> bytes:
    value = {"id": i, "customer": f"c{i % 7}", "amount": f"{i * 1.25:.2f}", "at": f"2026-11-01T{i % 24:02d}:00:00Z",
             "tags": {"a": i}, "address": {"city": f"x{i}", "zip": None}, "items": [str(i)]}
    if evolved:
        value["note"] = f"n{i}"
    return json.dumps(value).encode()


def test_delta_spark_reads_the_registered_tables_by_name_after_evolution_too(broker, topic, make_pipeline, reader,
                                                                             hive_metastore):
    database = f"bronze_{uuid.uuid4().hex[:8]}"
    catalog = {"type": "hive", "uri": hive_metastore.uri, "database": database, "table": "orders"}
    produced = broker.produce(topic, [(i % 3, str(i).encode(), record(i), None) for i in range(60)]
                              + [(0, b"bad", b"{not json", None), (2, b"bad", b'{"id": "x"}', None)])
    pipeline = make_pipeline(topic, format={"type": "json", "schema": RICH}, sink={"catalog": catalog})
    runner.run(pipeline, spark_factory=lambda: reader)

    # The database was created; both tables are external Delta tables at their locations.
    main = hive_table(hive_metastore, database, "orders")
    quarantine = hive_table(hive_metastore, database, "orders_quarantine")
    assert main.tableType == "EXTERNAL_TABLE" and main.parameters["spark.sql.sources.provider"] == "delta"
    assert main.sd.location == f"file:{pipeline.sink.table_uri}" == main.sd.serdeInfo.parameters["path"]
    assert quarantine.sd.location == f"file:{pipeline.sink.quarantine_uri}"
    columns = {c.name: c.type for c in main.sd.cols}
    assert columns["id"] == "bigint" and columns["amount"] == "decimal(12,2)" and columns["at"] == "timestamp"
    assert columns["tags"] == "map<string,int>" and columns["address"] == "struct<city:string,zip:string>"
    assert columns["items"] == "array<string>" and columns["_kafka_offset"] == "bigint"

    assert reader.sql(f"SELECT count(*) FROM {database}.orders").first()[0] == 60
    assert reader.sql(f"SELECT count(*) FROM {database}.orders_quarantine").first()[0] == 2

    # The schema evolves: the catalog's columns follow, and the reader sees the new column by name.
    produced += broker.produce(topic, [(i % 3, str(i).encode(), record(i, evolved=True), None) for i in range(60, 90)])
    evolved = make_pipeline(topic, format={"type": "json", "schema": RICH + ", note STRING"}, sink={"catalog": catalog})
    runner.run(evolved, spark_factory=lambda: reader)
    assert [c.name for c in hive_table(hive_metastore, database, "orders").sd.cols][-1] == "note"
    assert reader.sql(f"SELECT count(*), count(note) FROM {database}.orders").first()[:] == (90, 30)
    pairs = [(r[0], r[1]) for r in reader.sql(f"SELECT _kafka_partition, _kafka_offset FROM {database}.orders "
                                               f"UNION ALL SELECT _kafka_partition, _kafka_offset FROM "
                                               f"{database}.orders_quarantine").collect()]
    assert_exactly_once(pairs, produced)
    assert sorted(pairs) == sorted(read_pairs(evolved.sink.table_uri) + read_pairs(evolved.sink.quarantine_uri))


def test_a_run_whose_metastore_is_down_commits_fails_and_the_next_run_registers_what_it_committed(
        broker, topic, make_pipeline, reader, hive_metastore):
    database = f"bronze_{uuid.uuid4().hex[:8]}"
    catalog = {"type": "hive", "uri": f"thrift://127.0.0.1:{free_port()}", "database": database, "table": "orders"}
    produced = broker.produce(topic, [(i % 3, str(i).encode(), record(i), None) for i in range(20)])
    pipeline = make_pipeline(topic, format={"type": "json", "schema": RICH}, sink={"catalog": catalog})
    with pytest.raises(CatalogError) as failed:
        runner.run(pipeline, spark_factory=lambda: reader)
    assert "orders: committed 1 batch(es), 20 records written, 0 quarantined, table version" in str(failed.value)
    assert "but the tables are not registered: " in str(failed.value)
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)  # the commit landed, whole

    live = make_pipeline(topic, format={"type": "json", "schema": RICH}, sink={"catalog": {**catalog, "uri": hive_metastore.uri}})
    assert runner.run(live, spark_factory=lambda: reader).status == "no-op"
    assert reader.sql(f"SELECT count(*) FROM {database}.orders").first()[0] == 20
