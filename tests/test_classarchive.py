"""The driver JVM's class archive: written once by a run's JVM, adopted only once complete, used
by every later run (a JVM under -Xshare:on refuses to start from an archive it cannot map)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from oncemore import classarchive

from conftest import orders
from test_cli import oncemore


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(classarchive.ARCHIVE_ENV, raising=False)
    return tmp_path / "cache" / "oncemore" / "jvm"


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def written(final: Path, pid: int, age_seconds: float, size: int = 10) -> Path:
    path = final.with_name(f"{final.name}.{pid}.writing")
    path.write_bytes(b"x" * size)
    then = time.time() - age_seconds
    os.utime(path, (then, then))
    return path


def test_the_first_run_writes_the_archive_under_its_own_name(cache):
    final = classarchive.archive_path("4.0.0")
    assert classarchive.java_options("4.0.0", str(cache)).startswith(
        f"-XX:ArchiveClassesAtExit={final}.{os.getpid()}.writing ")
    assert final.parent == cache and not final.exists()


def test_an_archive_is_adopted_only_once_its_writer_is_gone_and_it_settled(cache):
    final = classarchive.archive_path("4.0.0")
    final.parent.mkdir(parents=True)
    young = written(final, dead_pid(), 1)  # just written: its JVM may still be dumping
    assert classarchive.java_options("4.0.0", str(cache)) is None, "one archive written at a time"
    young.unlink()
    live = written(final, os.getppid(), 600)  # a writer still running
    assert classarchive.java_options("4.0.0", str(cache)) is None
    assert live.exists() and not final.exists()

    empty = written(final, dead_pid(), 600, size=0)  # its JVM died before writing a byte
    complete = written(final, dead_pid(), 600)
    assert classarchive.java_options("4.0.0", str(cache)) == f"-XX:SharedArchiveFile={final}"
    assert final.exists() and not complete.exists() and not empty.exists() and live.exists()


def test_no_archive_when_turned_off_or_a_configuration_directory_is_on_the_class_path(cache, monkeypatch, tmp_path):
    assert classarchive.archive_path("4.0.0") != classarchive.archive_path("4.0.1")
    spark_home = tmp_path / "spark"
    (spark_home / "conf").mkdir(parents=True)
    assert classarchive.java_options("4.0.0", str(spark_home)) is not None  # an empty conf directory archives
    (spark_home / "conf" / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -Dx=1\n")
    assert classarchive.java_options("4.0.0", str(spark_home)) is None
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "elsewhere"))
    assert classarchive.java_options("4.0.0", str(cache)) is None
    monkeypatch.delenv("SPARK_CONF_DIR")
    monkeypatch.setenv(classarchive.ARCHIVE_ENV, "off")
    assert classarchive.java_options("4.0.0", str(cache)) is None


@pytest.mark.spark
def test_a_later_run_starts_its_jvm_from_the_archive_the_first_wrote(broker, topic, make_pipeline, tmp_path):
    broker.produce(topic, orders(0, 30))
    pipeline = make_pipeline(topic)
    cache = tmp_path / "cache"
    first = oncemore("run", "--config", pipeline.origin, env={"XDG_CACHE_HOME": str(cache)})
    assert first.returncode == 0, first.stderr[-3000:]
    jvm = cache / "oncemore" / "jvm"
    deadline = time.monotonic() + 120
    while subprocess.run(["pgrep", "-f", f"ArchiveClassesAtExit={jvm}"], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the JVM never finished writing its archive"
        time.sleep(0.5)
    (writing,) = jvm.glob("*.writing")
    assert writing.stat().st_size > 1 << 20
    os.utime(writing, (time.time() - 3600,) * 2)  # settled

    # Under -Xshare:on a JVM that cannot map the archive does not start.
    broker.produce(topic, orders(30, 30))
    second = oncemore("run", "--config", pipeline.origin, env={"XDG_CACHE_HOME": str(cache), "JDK_JAVA_OPTIONS": "-Xshare:on"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "committed 1 batch(es), 30 records written" in second.stdout
    assert [p.suffix for p in jvm.iterdir()] == [".jsa"]
