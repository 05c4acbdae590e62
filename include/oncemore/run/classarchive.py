"""A class-data archive of the Spark driver's JVM (Java's AppCDS), so a cold run starts its JVM
from classes already parsed and verified: measured here, a session and its first jobs in about
6 s instead of 11 s.

The first run on a machine (per Spark version and Java installation) asks its JVM to write the
archive when it exits (``-XX:ArchiveClassesAtExit``, about 2 s more that once), under a name of its
own (marked as the run starts, so runs starting meanwhile start without an archive rather than
write another); a later run adopts it once that run's process is gone and the file has not changed
for a while, so no run maps a half-written archive. Every later run starts from it
(``-XX:SharedArchiveFile``). The JVM checks an archive against itself and its class path and starts
without one it cannot use, so a stale archive costs speed, never a run (a truncated one, from a JVM
killed while writing it, is never rebuilt: delete it, or turn it off).
Lives in ``$XDG_CACHE_HOME/oncemore/jvm`` (``~/.cache``); ``ONCEMORE_JVM_ARCHIVE=off`` turns it off,
and so do a configuration directory on the class path (``SPARK_CONF_DIR`` and the like), a Java
runtime without a base archive, and a cache directory that cannot be written.
Only a driver JVM this process starts is concerned (``oncemore run`` on a local or standalone
master); spark-submit (Airflow's ingest task) starts its JVM before oncemore runs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path

ARCHIVE_ENV = "ONCEMORE_JVM_ARCHIVE"
SETTLED_SECONDS = 30  # an archive unchanged this long, its writer gone, is complete
ABANDONED_SECONDS = 24 * 3600  # a writer's mark this old is abandoned, whatever process has its pid now
# What puts directories on the driver's class path besides Spark's jars. The JVM archives no class
# path holding a non-empty directory (it fails at exit instead), so with any of them: no archive.
CLASS_PATH_ENV = ("SPARK_CONF_DIR", "HADOOP_CONF_DIR", "YARN_CONF_DIR", "SPARK_DIST_CLASSPATH", "SPARK_CLASSPATH")
JAVA_OPTIONS_ENV = ("JDK_JAVA_OPTIONS", "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS")


def java_options(spark_version: str, spark_home: str) -> str | None:
    """The driver JVM's option for the archive: use it, or write it at exit. None (no archive,
    the JVM starts as Spark starts it) when turned off, when the JVM could not write or map one,
    or when the cache cannot be used: the archive may cost speed, never a run."""
    if os.environ.get(ARCHIVE_ENV, "").lower() in ("off", "false", "0", "no"):
        return None
    conf = Path(spark_home, "conf")
    try:
        if any(os.environ.get(name) for name in CLASS_PATH_ENV) or (conf.is_dir() and any(conf.iterdir())):
            return None
        java = _java()
        # A dynamic archive stacks on the JDK's own base archive: without it (a minimal runtime,
        # -Xshare:off) a JVM asked to write one does not start.
        if java is None or not (java.parent.parent / "lib" / "server" / "classes.jsa").is_file() or any(
                "-Xshare:off" in os.environ.get(name, "") for name in JAVA_OPTIONS_ENV):
            return None
        final = archive_dir() / f"spark-{spark_version}-{_key(spark_version, spark_home, java)}.jsa"
        if re.search(r"[\s'\"\\]", str(final)):  # Spark splits the JVM's options at whitespace
            return None
        final.parent.mkdir(parents=True, exist_ok=True)
        being_written = _adopt_written(final)
        if final.exists():
            return f"-XX:SharedArchiveFile={final}"
        if being_written:  # by another run: this one starts without, rather than write a second
            return None
        mark = final.with_name(f"{final.name}.{os.getpid()}.writing")
        mark.touch()  # this run's: the JVM writes the archive over it as it exits
        return f"-XX:ArchiveClassesAtExit={mark} -Xlog:cds=off"  # its warnings list classes left out
    except (OSError, RuntimeError):  # no usable cache directory (read-only, no home)
        return None


def archive_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oncemore" / "jvm"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = shutil.which("java", path=os.path.join(home, "bin")) if home else shutil.which("java")
    return Path(os.path.realpath(found)) if found else None


def _key(spark_version: str, spark_home: str, java: Path) -> str:
    """Another Java installation, another Spark (a reinstall of the same version too): another archive."""
    jars = Path(spark_home, "jars")
    stamps = [os.stat(path).st_mtime_ns if path.exists() else 0 for path in (java, jars)]
    return hashlib.sha256(f"{spark_version}|{java}|{stamps}".encode()).hexdigest()[:16]


def _adopt_written(final: Path) -> bool:
    """Renames into place an archive an earlier run's JVM finished writing, and drops abandoned and
    superseded ones; True while one is still being written (its run alive, or its JVM just exited)."""
    being_written = False
    for written in sorted(final.parent.glob(f"{final.name}.*.writing")):
        try:
            age = time.time() - written.stat().st_mtime
            if (age < ABANDONED_SECONDS and _alive(int(written.name.split(".")[-2]))) or age < SETTLED_SECONDS:
                being_written = True
            elif written.stat().st_size and not final.exists():
                os.replace(written, final)
            else:
                written.unlink(missing_ok=True)
        except FileNotFoundError:  # another run adopted or dropped it meanwhile
            continue
    return being_written and not final.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
