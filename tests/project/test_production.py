"""The production topology on one machine: Delta tables on an S3 API server (moto), the job on a
Spark standalone cluster (master + worker from the pip PySpark), driven by the CLI as a scheduler
would. Counted by (partition, offset) with DuckDB over a copy of the tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_exactly_once, oncemore, orders, read_pairs
from devtools.sparkcluster import start_spark_cluster

pytestmark = pytest.mark.spark
S3_SECRET = "s3-secret-5c0ffee"


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory):
    cluster = start_spark_cluster(log_dir=str(tmp_path_factory.mktemp("spark-cluster")))
    yield cluster
    cluster.stop()


def test_a_run_on_a_spark_cluster_into_s3_tables_is_exactly_once(
        broker, topic, make_pipeline, s3_server, s3_bucket, spark_cluster, tmp_path, monkeypatch):
    records = orders(0, 3_000) + [(1, b"bad", b"{not json", None)]
    produced = broker.produce(topic, records)
    monkeypatch.setenv("ONCEMORE_TEST_S3_SECRET", S3_SECRET)
    options = {**s3_server.storage_options(), "AWS_SECRET_ACCESS_KEY": "${ONCEMORE_TEST_S3_SECRET}"}
    pipeline = make_pipeline(topic, sink={"table_uri": f"{s3_bucket}/delta/orders",
                                          "quarantine_uri": f"{s3_bucket}/delta/orders_quarantine",
                                          "storage_options": options})
    assert pipeline.sink.storage_options["conditional_put"] == "etag", "safe S3 commits unless told otherwise"

    first = oncemore("run", "--config", pipeline.origin, "--master", spark_cluster.master_url)
    again = oncemore("run", "--config", pipeline.origin, "--master", spark_cluster.master_url, check_no_spark=True)

    assert first.returncode == 0, first.stderr[-3000:]
    assert "3000 records written, 1 quarantined" in first.stdout
    assert again.returncode == 0 and "no-op" in again.stdout, again.stderr[-2000:]
    main = s3_server.download(pipeline.sink.table_uri, tmp_path / "main")
    quarantine = s3_server.download(pipeline.sink.quarantine_uri, tmp_path / "quarantine")
    assert_exactly_once(read_pairs(str(main)) + read_pairs(str(quarantine)), produced)
    # The tasks ran in the worker's executors, not in the driver.
    assert list(Path(spark_cluster.log_dir, "work").glob("app-*/*/stderr"))
    for output in (first.stdout, first.stderr):
        assert S3_SECRET not in output
    for log_file in (main / "_delta_log").glob("*.json"):
        assert S3_SECRET not in log_file.read_text()
