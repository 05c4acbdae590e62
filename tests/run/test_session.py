"""The driver JVM of a session oncemore starts: a serial collector whose young generation starts
small, unless the user gives the JVM options of their own; and its Python workers' daemon, with
PySpark imported from its installed package."""

from __future__ import annotations

import os
import sys
import zipimport

import pyspark
import pytest
from pyspark import SparkContext

from conftest import ROOT
from oncemore.run import classarchive, session, workerdaemon

INCLUDE = ROOT / "include"


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
        with open(f"/proc/{os.getppid()}/maps") as maps:
            libraries = sorted({name for name in ("librdkafka", "libarrow", "pandas") if name in maps.read()})
        archives = [p for p in [*sys.path, *sys.path_importer_cache] if "pyspark.zip" in p or ".jar" in p]
        for _ in batches:
            yield pa.RecordBatch.from_pylist([{"parent": parent, "pyspark": pyspark.__file__, "archives": archives,
                                               "libraries": libraries}])

    rows = spark.range(0, 2, 1, 2).mapInArrow(
        where_workers_import_from, "parent string, pyspark string, archives array<string>, libraries array<string>").collect()

    assert len(rows) == 2
    for row in rows:
        assert f"-m {session.WORKER_DAEMON}" in row.parent
        assert row.pyspark == pyspark.__file__  # the installed package, as this process imports it
        assert row.archives == []  # Spark's pyspark.zip and its jar: off the path, and no importer of theirs left
        assert row.libraries == []  # the daemon of a run's own session loads no library before it forks


def installed_spark(site, version="4.2.0"):
    """A pip-installed pyspark in ``site``: the package, its Spark home's zip and jars."""
    (site / "pyspark" / "jars").mkdir(parents=True)
    (site / "pyspark" / "__init__.py").write_text("")
    (site / "pyspark" / "version.py").write_text(f'__version__: str = "{version}"\n')
    lib = site / "pyspark" / "python" / "lib"
    return (str(lib / "pyspark.zip"), str(lib / "py4j-0.10.9.9-src.zip"),
            str(site / "pyspark" / "jars" / "spark-core_2.13-4.2.0.jar"))


def test_the_daemon_takes_off_the_path_only_what_the_installed_pyspark_package_also_holds(monkeypatch, tmp_path):
    site = tmp_path / "site-packages"
    archive, py4j, jar = installed_spark(site)
    users_jar = str(site / "pyspark" / "jars" / "graphframes.jar")  # a jar of the user's, which may hold Python
    unreadable = str(tmp_path / ("x" * 300))  # stat() fails (File name too long): Python's imports pass it by
    monkeypatch.setattr(sys, "path", [unreadable, archive, py4j, jar, users_jar, str(site)])
    monkeypatch.setattr(sys, "path_importer_cache", {archive: object(), f"{jar}/org": object(), str(site): object()})
    monkeypatch.setattr(zipimport, "_zip_directory_cache", {archive: {}, jar: {}, py4j: {}})

    workerdaemon.installed_pyspark_first()

    assert sys.path == [unreadable, py4j, users_jar, str(site)]
    assert list(sys.path_importer_cache) == [str(site)]
    assert list(zipimport._zip_directory_cache) == [py4j]


@pytest.mark.parametrize("case", ["a distribution of its own", "another version installed", "through a symlink"])
def test_the_daemon_tells_the_installed_package_by_its_resolved_path_and_its_version(case, monkeypatch, tmp_path):
    site = tmp_path / "site-packages"
    archive, py4j, jar = installed_spark(site, version="4.2.1" if case == "another version installed" else "4.2.0")
    if case == "a distribution of its own":  # the code its JVM speaks to, whatever is installed beside
        archive, jar = "/opt/spark/python/lib/pyspark.zip", "/opt/spark/jars/spark-core_2.13-4.2.0.jar"
    path = [archive, py4j, jar, str(site)]
    if case == "through a symlink":  # Spark's home resolved (find_spark_home), the path as given
        (tmp_path / "link").symlink_to(site)
        path[-1] = str(tmp_path / "link")
    monkeypatch.setattr(sys, "path", list(path))
    monkeypatch.setattr(sys, "path_importer_cache", {})

    workerdaemon.installed_pyspark_first()

    if case == "through a symlink":
        assert sys.path == [py4j, path[-1]]
    else:  # kept: the code its JVM speaks to
        assert sys.path == path


def test_a_session_s_workers_fork_from_oncemores_daemon_only_where_they_find_this_package_on_a_local_master(
        monkeypatch, tmp_path):
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)  # as in a process about to start its JVM
    for name in (*session.MASTER_NAMING_ENV, "PYSPARK_GATEWAY_PORT", "PYSPARK_PYTHON", "SPARK_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(INCLUDE))
    monkeypatch.chdir(tmp_path)
    assert session.workers_import_oncemore_here("local[2]")
    assert session.workers_import_oncemore_here(None)  # Spark's default: local[*]
    assert not session.workers_import_oncemore_here("spark://elsewhere:7077")  # executors may lack the package
    for name in session.MASTER_NAMING_ENV:  # a master named there may be a cluster
        with monkeypatch.context() as changed:
            changed.setenv(name, "spark://elsewhere:7077" if name == "MASTER" else str(tmp_path))
            assert not session.workers_import_oncemore_here(None), name
            assert session.workers_import_oncemore_here("local[2]"), name
    with monkeypatch.context() as changed:
        changed.setenv("PYSPARK_PYTHON", "/usr/bin/python3")  # another interpreter: its own path and libraries
        assert not session.workers_import_oncemore_here("local[2]")
    with monkeypatch.context() as changed:
        changed.setenv("PYTHONPATH", str(tmp_path))  # the package only on this process's sys.path
        assert not session.workers_import_oncemore_here("local[2]")
        changed.chdir(INCLUDE)  # as `python -m oncemore.cli` run from include/
        assert session.workers_import_oncemore_here("local[2]")
    with monkeypatch.context() as changed:
        changed.setenv("PYSPARK_GATEWAY_PORT", "4321")  # spark-submit started the JVM, with its own settings
        assert not session.workers_import_oncemore_here("local[2]")
