"""The JVM packages a Spark user adds to the pip PySpark (delta-spark 4.4, Spark's Kafka and Avro
connectors), for the tests and benchmarks that play that user: the jars scripts/setup copied for
devtools/spark/pom.xml, and the session settings that turn Delta on. oncemore itself loads none
of them.

A process holds one SparkContext: a test process whose classic session is oncemore's own reaches
delta-spark through a Connect server started with these (``start_delta_connect_server``); a
process of its own takes them on spark-submit's command line (``submit_arguments``).
"""

from __future__ import annotations

from pathlib import Path

from devtools.kafkabroker import setup_cache_dir

SPARK_POM = Path(__file__).resolve().parent / "spark" / "pom.xml"
# What a session needs for Delta tables by path and by name (delta.`path`, SQL DDL on them).
DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def spark_jars_dir() -> Path:
    """The jars scripts/setup copied for devtools/spark/pom.xml."""
    return setup_cache_dir(SPARK_POM, "spark", "the Spark packages' jars (delta-spark, Kafka and Avro connectors)")


def spark_jars() -> list[Path]:
    """Every jar of ``spark_jars_dir()``, sorted: what ``--jars`` (spark.jars) takes."""
    return sorted(spark_jars_dir().glob("*.jar"))


def submit_arguments(conf: dict[str, str] | None = None) -> list[str]:
    """spark-submit's options for a session with these jars and Delta on, plus ``conf``."""
    settings = {**DELTA_CONF, **(conf or {})}
    return ["--jars", ",".join(map(str, spark_jars())),
            *[part for key, value in settings.items() for part in ("--conf", f"{key}={value}")]]


def start_delta_connect_server(master: str = "local[2]", conf: dict[str, str] | None = None, **kwargs):
    """A Connect server (sparkconnect.start_connect_server, same arguments) whose sessions have
    delta-spark and the Kafka and Avro connectors."""
    from devtools.sparkconnect import start_connect_server

    return start_connect_server(master, jars=spark_jars(), conf={**DELTA_CONF, **(conf or {})}, **kwargs)
