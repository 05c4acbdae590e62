"""A class-data archive of the Spark driver's JVM (Java's AppCDS), so a cold run starts its JVM
from classes already parsed and verified: measured here, a session and its first jobs in about
6 s instead of 11 s.

The first run on a machine (per Spark version and Java installation) asks its JVM to write the
archive when it exits (``-XX:ArchiveClassesAtExit``, about 2 s more that once), under a name of its
own; a later run adopts it once its writer is gone and it has not changed for a while, so no run
ever maps a half-written archive, and while one is being written other runs start without one
rather than write another. Every
later run starts from it (``-XX:SharedArchiveFile``). The JVM checks an archive against itself and
its class path and starts without one it cannot use, so a stale archive costs speed, never a run.
Lives in ``$XDG_CACHE_HOME/oncemore/jvm`` (``~/.cache``); ``ONCEMORE_JVM_ARCHIVE=off`` turns it off,
and so does a configuration directory on the class path (``SPARK_CONF_DIR`` and the like).
Only a driver JVM this process starts is concerned (``oncemore run`` on a local or standalone
master); spark-submit (Airflow's ingest task) starts its JVM before oncemore runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

ARCHIVE_ENV = "ONCEMORE_JVM_ARCHIVE"
SETTLED_SECONDS = 30  # an archive unchanged this long, its writer gone, is complete


def archive_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oncemore" / "jvm"


# What puts directories on the driver's class path besides Spark's jars. The JVM archives no class
# path holding a non-empty directory (it fails at exit instead), so with any of them: no archive.
CLASS_PATH_ENV = ("SPARK_CONF_DIR", "HADOOP_CONF_DIR", "YARN_CONF_DIR", "SPARK_DIST_CLASSPATH", "SPARK_CLASSPATH")


def archive_path(spark_version: str) -> Path:
    """The archive of this Spark version on this Java installation (another JDK: another archive)."""
    java = os.path.realpath(shutil.which("java", path=os.path.join(os.environ["JAVA_HOME"], "bin"))
                            if os.environ.get("JAVA_HOME") else shutil.which("java") or "java")
    stamp = os.stat(java).st_mtime_ns if os.path.exists(java) else 0
    key = hashlib.sha256(f"{spark_version}|{java}|{stamp}".encode()).hexdigest()[:16]
    return archive_dir() / f"spark-{spark_version}-{key}.jsa"


def java_options(spark_version: str, spark_home: str) -> str | None:
    """The driver JVM's option for the archive: use it, or write it at exit; None when turned off
    or when configuration directories are on the class path."""
    if os.environ.get(ARCHIVE_ENV, "").lower() in ("off", "false", "0", "no"):
        return None
    conf = Path(spark_home, "conf")
    if any(os.environ.get(name) for name in CLASS_PATH_ENV) or (conf.is_dir() and any(conf.iterdir())):
        return None
    final = archive_path(spark_version)
    final.parent.mkdir(parents=True, exist_ok=True)
    being_written = False if final.exists() else _adopt_written(final)
    if final.exists():
        return f"-XX:SharedArchiveFile={final}"
    if being_written:  # by another run: this one starts without, rather than write a second
        return None
    return f"-XX:ArchiveClassesAtExit={final}.{os.getpid()}.writing -Xlog:cds=off"  # its warnings list classes left out


def _adopt_written(final: Path) -> bool:
    """Renames into place an archive an earlier run's JVM finished writing, and drops abandoned
    ones; True while one is still being written."""
    being_written = False
    for written in sorted(final.parent.glob(f"{final.name}.*.writing")):
        pid = int(written.name.split(".")[-2])
        if _alive(pid) or time.time() - written.stat().st_mtime < SETTLED_SECONDS:
            being_written = True
        elif written.stat().st_size and not final.exists():
            os.replace(written, final)
        else:
            written.unlink(missing_ok=True)
    return being_written and not final.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
