"""The JVM packages a Spark user adds to PySpark (devtools/spark/pom.xml, devtools.sparkjars): none
repeats a jar PySpark ships. A Connect server started with them is
tests/commit/test_delta_spark.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyspark

from devtools.sparkjars import spark_jars


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
