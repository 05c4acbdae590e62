"""The driver JVM's class archive: written once by a run's JVM, adopted only once complete, used
by every later run (a JVM under -Xshare:on refuses to start from an archive it cannot map)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import assert_exactly_once, oncemore, orders, read_pairs
from oncemore.run import classarchive


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


def archive(options: str | None) -> Path:
    return Path(options.split()[0].split("=", 1)[1])


def test_the_first_run_writes_the_archive_under_its_own_name_and_marks_it(cache, tmp_path):
    options = classarchive.java_options("4.0.0", str(tmp_path))
    mark = archive(options)
    assert options.startswith("-XX:ArchiveClassesAtExit=") and mark.name.endswith(f".{os.getpid()}.writing")
    assert mark.parent == cache and mark.exists(), "runs starting meanwhile see it is being written"
    assert classarchive.java_options("4.0.0", str(tmp_path)) is None, "one writer at a time"


def test_an_archive_is_adopted_only_once_its_writer_is_gone_and_it_settled(cache, tmp_path):
    mark = archive(classarchive.java_options("4.0.0", str(tmp_path)))
    final = mark.with_name(mark.name.split(".jsa.")[0] + ".jsa")
    mark.unlink()
    young = written(final, dead_pid(), 1)  # just written: its JVM may still be dumping
    assert classarchive.java_options("4.0.0", str(tmp_path)) is None, "one archive written at a time"
    young.unlink()
    live = written(final, os.getppid(), 600)  # a writer still running
    assert classarchive.java_options("4.0.0", str(tmp_path)) is None
    assert live.exists() and not final.exists()

    empty = written(final, dead_pid(), 600, size=0)  # its JVM died before writing a byte
    complete = written(final, dead_pid(), 600)
    assert classarchive.java_options("4.0.0", str(tmp_path)) == f"-XX:SharedArchiveFile={final}"
    assert final.exists() and not complete.exists() and not empty.exists() and live.exists()
    old_live = written(final, 1, 2 * classarchive.ABANDONED_SECONDS)  # its pid taken by another process
    late = written(final, dead_pid(), 600)  # written after the archive was adopted
    classarchive.java_options("4.0.0", str(tmp_path))
    assert not old_live.exists() and not late.exists() and live.exists()


def test_no_archive_where_the_jvm_could_not_write_or_map_one_or_the_cache_is_unusable(cache, monkeypatch, tmp_path):
    spark_home = tmp_path / "spark"
    (spark_home / "conf").mkdir(parents=True)
    assert classarchive.java_options("4.0.0", str(spark_home)) is not None  # an empty conf directory archives
    (spark_home / "conf" / "spark-defaults.conf").write_text("spark.driver.extraJavaOptions -Dx=1\n")
    assert classarchive.java_options("4.0.0", str(spark_home)) is None  # a non-empty one cannot be archived
    home = str(tmp_path)
    for name, value in (("SPARK_CONF_DIR", str(tmp_path / "elsewhere")), (classarchive.ARCHIVE_ENV, "off"),
                        ("JDK_JAVA_OPTIONS", "-Xshare:off"),  # no base archive: a dumping JVM would not start
                        ("JAVA_HOME", str(tmp_path / "no-jdk")),
                        ("XDG_CACHE_HOME", "/proc/no-cache-here"), ("XDG_CACHE_HOME", str(tmp_path / "a space"))):
        with monkeypatch.context() as changed:
            changed.setenv(name, value)
            assert classarchive.java_options("4.0.0", home) is None, (name, value)
    jre = tmp_path / "jre"  # a runtime without the JDK's base archive (jlink'd, minimal)
    (jre / "bin").mkdir(parents=True)
    (jre / "bin" / "java").write_text("#!/bin/sh\n")
    (jre / "bin" / "java").chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(jre))
    assert classarchive.java_options("4.0.0", home) is None


@pytest.mark.spark
def test_a_later_run_starts_its_jvm_from_the_archive_the_first_wrote(broker, topic, make_pipeline, tmp_path):
    produced = broker.produce(topic, orders(0, 30))
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
    produced += broker.produce(topic, orders(30, 30))
    second = oncemore("run", "--config", pipeline.origin, env={"XDG_CACHE_HOME": str(cache), "JDK_JAVA_OPTIONS": "-Xshare:on"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "committed 1 batch(es), 30 records written" in second.stdout
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)
    assert [p.suffix for p in jvm.iterdir()] == [".jsa"]
