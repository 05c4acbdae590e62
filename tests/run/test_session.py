"""The driver JVM of a session oncemore starts: a serial collector whose young generation starts
small, unless the user gives the JVM options of their own."""

from __future__ import annotations

import os

import pyspark
import pytest
from pyspark import SparkContext

from oncemore.run import classarchive, session


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
