"""A Spark session able to run oncemore jobs: the package shipped to executors, the sources registered.

Imported only once a run has work to do: a no-op run never starts a JVM.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

from .redaction import SPARK_CONF_REGEX, spark_options_regex

MASTER_ENV = "ONCEMORE_SPARK_MASTER"


def spark_session(master: str | None = None):
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("oncemore")
    master = master or os.environ.get(MASTER_ENV)
    if master:
        builder = builder.master(master)
    spark = (
        builder.config("spark.sql.session.timeZone", "UTC")
        # librdkafka and storage settings travel as data source options (kafka.*, storage.*): every
        # one not known harmless is masked in plans, logs and the UI (redaction.py).
        .config("spark.redaction.regex", SPARK_CONF_REGEX)
        .config("spark.sql.redaction.options.regex", spark_options_regex())
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "50000")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    if "oncemore" not in spark.conf.get("spark.submit.pyFiles", ""):
        spark.sparkContext.addPyFile(package_zip())
    register_sources(spark)
    return spark


def register_sources(spark) -> None:
    from .sink import DeltaSinkDataSource
    from .source import KafkaIngestDataSource, KafkaRangeDataSource, KafkaRecordsDataSource

    for source in (KafkaRangeDataSource, KafkaIngestDataSource, KafkaRecordsDataSource, DeltaSinkDataSource):
        spark.dataSource.register(source)


@lru_cache(maxsize=1)
def package_zip() -> str:
    """The oncemore package as a zip for --py-files / addPyFile (executors must not rely on the driver's cwd)."""
    package = Path(__file__).resolve().parent
    target = Path(tempfile.mkdtemp(prefix="oncemore-pkg-")) / "oncemore.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(package.rglob("*.py")):
            archive.write(path, path.relative_to(package.parent))
    return str(target)
