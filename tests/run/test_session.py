"""The driver JVM of a session oncemore starts: a serial collector whose young generation starts
small, unless the user gives the JVM options of their own."""

from __future__ import annotations

import os

import pytest
from pyspark import SparkContext

from oncemore.run import classarchive, session


@pytest.mark.spark
def test_the_driver_jvm_of_a_session_oncemore_starts_collects_serially_from_a_small_young_generation(spark):
    jvm = spark.sparkContext._jvm
    management = jvm.java.lang.management.ManagementFactory
    arguments = list(management.getRuntimeMXBean().getInputArguments())
    collectors = sorted(bean.getName() for bean in management.getGarbageCollectorMXBeans())
    # As this process's environment leaves it (the fixture's session was started from it).
    if any(os.environ.get(name) for name in session.USER_JVM_ENV):
        assert "-XX:+UseSerialGC" not in arguments
    else:
        assert {"-XX:+UseSerialGC", "-XX:NewSize=16m"} <= set(arguments)
        assert collectors == ["Copy", "MarkSweepCompact"]  # the serial collector's young and old


def test_jvm_options_of_the_user_leave_the_driver_jvm_s_memory_to_them(monkeypatch, tmp_path):
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)  # as in a process about to start its JVM
    for name in (*session.USER_JVM_ENV, "PYSPARK_GATEWAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(classarchive.ARCHIVE_ENV, "off")
    spark_home = tmp_path / "spark"
    (spark_home / "conf").mkdir(parents=True)
    monkeypatch.setenv("SPARK_HOME", str(spark_home))
    assert session.driver_java_options() == session.DRIVER_JVM_MEMORY
    for name in session.USER_JVM_ENV:
        with monkeypatch.context() as changed:
            changed.setenv(name, "-XX:+UseG1GC" if name != "SPARK_CONF_DIR" else str(tmp_path))
            assert session.driver_java_options() is None, name
    (spark_home / "conf" / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -XX:+UseZGC\n")
    assert session.driver_java_options() is None
