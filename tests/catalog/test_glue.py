"""Catalog registration in AWS Glue, through moto's server (the local S3 API server speaks Glue's
API too), on tables in its S3: the endpoint, region and credentials come from AWS's standard
environment; boto3's get_table shows the tables' locations and columns, after evolution too.
"""

from __future__ import annotations

import json
import uuid

import boto3
import pytest

from oncemore.run import runner

pytestmark = pytest.mark.spark


@pytest.fixture
def glue(s3_server, monkeypatch):
    """AWS's environment pointed at the local server: what oncemore's Glue client reads."""
    options = s3_server.storage_options()
    for key in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, options[key])
    return boto3.client("glue", endpoint_url=options["AWS_ENDPOINT_URL"], region_name=options["AWS_REGION"],
                        aws_access_key_id=options["AWS_ACCESS_KEY_ID"], aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"])


def test_glue_get_table_shows_both_tables_locations_and_columns(broker, topic, make_pipeline, spark, s3_server,
                                                               s3_bucket, glue):
    database = f"bronze_{uuid.uuid4().hex[:8]}"
    sink = {"table_uri": f"{s3_bucket}/orders", "quarantine_uri": f"{s3_bucket}/orders_quarantine",
            "storage_options": s3_server.storage_options(),
            "catalog": {"type": "glue", "database": database, "table": "orders"}}
    broker.produce(topic, [(i % 3, None, json.dumps({"id": i, "customer": f"c{i}", "amount": i / 4}).encode(), None)
                           for i in range(30)] + [(1, None, b"{broken", None)])
    runner.run(make_pipeline(topic, sink=sink), spark_factory=lambda: spark)

    main = glue.get_table(DatabaseName=database, Name="orders")["Table"]
    assert main["TableType"] == "EXTERNAL_TABLE" and main["Parameters"]["spark.sql.sources.provider"] == "delta"
    assert main["StorageDescriptor"]["Location"] == f"{s3_bucket}/orders"
    assert main["StorageDescriptor"]["SerdeInfo"]["Parameters"]["path"] == f"{s3_bucket}/orders"
    columns = [(c["Name"], c["Type"]) for c in main["StorageDescriptor"]["Columns"]]
    assert columns[:3] == [("id", "bigint"), ("customer", "string"), ("amount", "double")]
    assert ("_kafka_partition", "int") in columns and ("_kafka_offset", "bigint") in columns
    quarantine = glue.get_table(DatabaseName=database, Name="orders_quarantine")["Table"]
    assert quarantine["StorageDescriptor"]["Location"] == f"{s3_bucket}/orders_quarantine"
    assert "error" in [c["Name"] for c in quarantine["StorageDescriptor"]["Columns"]]

    # A column added to the schema reaches Glue with the commit that brings it.
    broker.produce(topic, [(0, None, json.dumps({"id": 99, "customer": "z", "amount": 1.0, "note": "n"}).encode(), None)])
    evolved = make_pipeline(topic, sink=sink, format={"type": "json", "schema": "id BIGINT, customer STRING, "
                                                                                "amount DOUBLE, note STRING"})
    runner.run(evolved, spark_factory=lambda: spark)
    columns = [c["Name"] for c in glue.get_table(DatabaseName=database, Name="orders")["Table"]["StorageDescriptor"]["Columns"]]
    assert columns[-1] == "note"
    assert runner.run(evolved, spark_factory=lambda: spark).status == "no-op"
    assert len(glue.get_table_versions(DatabaseName=database, TableName="orders")["TableVersions"]) == 2
