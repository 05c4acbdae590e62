"""The JVM packages a Spark user adds to PySpark (devtools/spark/pom.xml, oncemore.devspark): none
repeats a jar PySpark ships, and a Connect server started with them is a delta-spark that reads
what oncemore wrote, changes the table as a Spark user would, and reads oncemore's next commit.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyspark
import pytest

from oncemore.devspark import spark_jars, start_delta_connect_server

from conftest import ROOT, orders


def artifact(jar: str) -> str:
    """A jar's file name without its version (which starts at the first "-digit" part holding a dot),
    as scripts/setup compares them."""
    return re.match(r"^(.*?)-\d[^-_]*\.", jar).group(1)


def test_the_packages_hold_delta_and_the_connectors_and_no_jar_pyspark_ships():
    names = {artifact(jar.name) for jar in spark_jars()}
    shipped = {artifact(jar.name) for jar in (Path(pyspark.__file__).parent / "jars").glob("*.jar")}

    assert {"delta-spark_2.13", "delta-storage", "spark-sql-kafka-0-10_2.13", "kafka-clients", "spark-avro_2.13"} <= names
    assert not names & shipped
    assert "spark-core_2.13" in shipped and "hadoop-client-api" in shipped  # the comparison sees PySpark's jars


@pytest.fixture(scope="module")
def delta_server(tmp_path_factory):
    server = start_delta_connect_server("local[1]", log_dir=str(tmp_path_factory.mktemp("delta-connect")),
                                        conf={"spark.sql.shuffle.partitions": "2"})
    yield server
    server.stop()


@pytest.mark.spark
def test_delta_spark_over_connect_reads_an_oncemore_table_and_deletes_from_it(broker, topic, make_pipeline,
                                                                              delta_server):
    from pyspark.sql import SparkSession

    def ingest() -> None:  # oncemore's run on the same server, in a process of its own
        env = {**os.environ, "PYTHONPATH": str(ROOT / "include"), "SPARK_REMOTE": delta_server.url}
        done = subprocess.run([sys.executable, "-m", "oncemore.cli", "run", "--config", pipeline.origin], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]

    broker.produce(topic, orders(0, 300))
    pipeline = make_pipeline(topic)
    ingest()
    path = pipeline.sink.table_uri
    spark = SparkSession.builder.remote(delta_server.url).create()
    try:
        def rows() -> tuple[int, int]:
            found = spark.sql(f"SELECT count(*), count(DISTINCT _kafka_partition, _kafka_offset) FROM delta.`{path}`").first()
            return found[0], found[1]

        assert rows() == (300, 300)
        spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')")
        assert spark.sql(f"DELETE FROM delta.`{path}` WHERE id % 50 = 0").first()[0] == 6

        broker.produce(topic, orders(300, 300))
        ingest()

        assert rows() == (594, 594)
    finally:
        spark.stop()
        os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)  # the process's other sessions are classic
