"""The driver JVM of a session oncemore starts: a serial collector whose young generation starts
small, unless the user gives the JVM options of their own; and its Python workers' daemon, with
PySpark imported from its installed package."""

from __future__ import annotations

import os
import sys

import pyspark
import pytest
from pyspark import SparkContext

from oncemore.run import classarchive, session, workerdaemon


@pytest.mark.spark
def test_the_driver_jvm_of_a_session_oncemore_starts_collects_serially_from_a_small_young_generation(spark):
    management = spark.sparkContext._jvm.java.lang.management.ManagementFactory
    arguments = set(management.getRuntimeMXBean().getInputArguments())
    collectors = sorted(bean.getName() for bean in management.getGarbageCollectorMXBeans())
    # As this process's environment and Spark's home leave it (the fixture's session was started
    # from them); the user's own options may name the serial collector themselves.
    if session.jvm_options_are_users(os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)):
        assert session.DRIVER_JVM_MEMORY not in spark.sparkContext.getConf().get("spark.driver.extraJavaOptions", "")
    else:
        assert {"-XX:+UseSerialGC", "-XX:NewSize=16m"} <= arguments
        assert collectors == ["Copy", "MarkSweepCompact"]  # the serial collector's young and old


def test_jvm_options_of_the_user_leave_the_driver_jvm_s_memory_to_them(monkeypatch, tmp_path):
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)  # as in a process about to start its JVM
    for name in (*session.USER_JVM_ENV, "PYSPARK_GATEWAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    spark_home = tmp_path / "spark"
    (spark_home / "conf").mkdir(parents=True)
    (spark_home / "conf" / "spark-defaults.conf.template").write_text("# a distribution's template\n")
    monkeypatch.setenv("SPARK_HOME", str(spark_home))
    monkeypatch.setattr(classarchive, "java_options", lambda version, home: "-XX:SharedArchiveFile=/a.jsa")
    assert session.driver_java_options() == f"{session.DRIVER_JVM_MEMORY} -XX:SharedArchiveFile=/a.jsa"
    # The user's options leave the memory's out, and the class archive's in.
    for name in session.USER_JVM_ENV:
        with monkeypatch.context() as changed:
            changed.setenv(name, "-XX:+UseG1GC" if name != "SPARK_CONF_DIR" else str(tmp_path))
            assert session.driver_java_options() == "-XX:SharedArchiveFile=/a.jsa", name
    for name in session.USER_JVM_FILES:
        (spark_home / "conf" / name).write_text("-XX:+UseZGC\n")
        assert session.driver_java_options() == "-XX:SharedArchiveFile=/a.jsa", name
        (spark_home / "conf" / name).unlink()
    monkeypatch.setattr(classarchive, "java_options", lambda version, home: None)
    assert session.driver_java_options() == session.DRIVER_JVM_MEMORY


@pytest.mark.spark
def test_the_python_workers_of_a_local_session_fork_from_oncemores_daemon_and_import_pyspark_from_its_package(spark):
    def where_workers_import_from(batches):
        import sys

        import pyarrow as pa
        import pyspark

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            parent = cmdline.read().replace(b"\0", b" ").decode()
        archives = [p for p in [*sys.path, *sys.path_importer_cache] if "pyspark.zip" in p or ".jar" in p]
        for _ in batches:
            yield pa.RecordBatch.from_pylist([{"parent": parent, "pyspark": pyspark.__file__, "archives": archives}])

    rows = spark.range(0, 2, 1, 2).mapInArrow(where_workers_import_from,
                                              "parent string, pyspark string, archives array<string>").collect()

    assert len(rows) == 2
    for row in rows:
        assert f"-m {session.WORKER_DAEMON}" in row.parent
        assert row.pyspark == pyspark.__file__  # the installed package, as this process imports it
        assert row.archives == []  # Spark's pyspark.zip and its jar: off the path, and no importer of theirs left


def test_the_daemon_takes_off_the_path_only_what_the_installed_pyspark_package_also_holds(monkeypatch, tmp_path):
    site = tmp_path / "site-packages"
    (site / "pyspark").mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    installed_zip = str(site / "pyspark" / "python" / "lib" / "pyspark.zip")
    installed_py4j = str(site / "pyspark" / "python" / "lib" / "py4j-0.10.9.9-src.zip")
    installed_jar = str(site / "pyspark" / "jars" / "spark-core_2.13-4.2.0.jar")
    # A Spark distribution of its own: the code its JVM speaks to, whatever is installed beside.
    distribution_zip, distribution_jar = "/opt/spark/python/lib/pyspark.zip", "/opt/spark/jars/spark-core_2.13-4.2.0.jar"
    monkeypatch.setattr(sys, "path", [installed_zip, installed_py4j, installed_jar, distribution_zip, distribution_jar,
                                      str(site)])
    monkeypatch.setattr(sys, "path_importer_cache", {installed_zip: object(), f"{installed_jar}/org": object(),
                                                     distribution_zip: object(), str(site): object()})

    workerdaemon.installed_pyspark_first()

    assert sys.path == [installed_py4j, distribution_zip, distribution_jar, str(site)]
    assert list(sys.path_importer_cache) == [distribution_zip, str(site)]
