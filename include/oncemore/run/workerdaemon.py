"""The Python worker daemon of oncemore's Spark (``spark.python.daemon.module=oncemore.run.workerdaemon``:
a session ``oncemore run`` starts on a local master, the Connect server): PySpark's own daemon, which
forks a Python worker per task slot, with PySpark imported from its installed package, and on a
resident Spark the libraries every oncemore task imports already loaded.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip``, and the jar of its own classes, ahead of
everything on its workers' path. Where that Spark home is the pyspark package installed beside
(pip's), the zip holds the same modules without their compiled bytecode: the daemon and each worker
compiled PySpark's modules again (``import pyspark.worker`` took 0.65 s from the zip, 0.11 s from
the package), and each worker's first task re-read the directories of the zip and of the jar, which
holds no Python, once for every package imported through them (Python 3.11's zipimport, on PySpark's
``importlib.invalidate_caches()``). Measured, a 1 M-record ``oncemore run`` on ``local[2]``: 8.4-9.2 s
against 9.1-9.7 s, each task worker 15-20 MiB smaller and the daemon 12 (docs/performance.md, "The
workers' PySpark"). A Spark home of its own (a cluster's distribution) keeps its zip and jar: that
is the code its JVM speaks to.

Spark stops a Python worker after a minute idle (a fixed interval in its PythonWorkerFactory), so
every hourly run on a warm server started new workers, and each paid these imports again: pandas
alone, which pyarrow imports on the first ``pa.array``, took 0.2-0.3 s of a task's first read
(measured, benchmarks/fixed_cost.py "after idle"). A session oncemore starts (``OWN_WORKERS_ENV``)
has its daemon for one run: it loads nothing before forking, as its workers import what their
tasks need (an ingest task no pandas), and the daemon's own memory would count on top.

Invariant: no oncemore module stays loaded in the daemon. A worker imports oncemore from what its
session shipped (the package zip, an artifact), never from the daemon's own copy, whatever version
either is: ``python -m`` imported the package to run this module, and it is forgotten before the
first fork.

Forking after these imports is safe. PySpark's own daemon imports after the fork because it cannot
know what a worker imports, and some libraries start threads. Of these, numpy's OpenBLAS starts
none under the OMP_NUM_THREADS=1 Spark gives its workers' daemon. Arrow starts jemalloc's
background thread, which jemalloc's own fork handlers re-create in a child when needed. Measured:
the daemon holds those two threads, each forked worker one.
"""

from __future__ import annotations

import os
import re
import sys
import zipimport

# Set for the Python workers of a session oncemore starts (run/session.py), never on a Spark Connect
# server's, which other users' jobs share: see this module's docstring and workermemory.pandas_kept_out.
OWN_WORKERS_ENV = "ONCEMORE_OWN_WORKERS"
# The jar Spark puts on its workers' path (PythonUtils.sparkPythonPath: the jar of its own classes), by
# Spark's version; and how the pyspark package's version.py gives its version.
_SPARK_CORE = re.compile(r"spark-core_[0-9.]+-(?P<version>.+)\.jar")
_VERSION = re.compile(r"""^__version__(?:: str)? = ["']([^"']+)["']""", re.M)
# What a task of each oncemore source imports whatever the pipeline's formats (tasks, records,
# the json decoder, the file writer), and PySpark's worker, which its daemon would import in every fork.
PRELOADED = ("pyspark.worker", "numpy", "pandas", "pyarrow", "pyarrow.compute", "pyarrow.fs", "pyarrow.json",
             "pyarrow.parquet", "confluent_kafka")


def installed_pyspark_first() -> None:
    """Takes Spark home's ``python/lib/pyspark.zip`` and its ``spark-core`` jar off the path where
    that home is the pyspark package of a directory on the path, of the jar's version (the module
    docstring): PySpark then imports from the package, as the driver does. Forgets what Python kept
    of the two archives: their importers, each of which re-reads its archive's directory on every
    ``importlib.invalidate_caches()``, and the directories (4 MiB, in every forked worker). Changes
    nothing it cannot tell is the same code: a path entry that cannot be read counts as absent."""
    jars = [e for e in sys.path if _SPARK_CORE.fullmatch(os.path.basename(e))]
    zips = [e for e in sys.path if os.path.basename(e) == "pyspark.zip"]
    if len(jars) != 1 or len(zips) != 1:
        return
    (jar,), (archive,) = jars, zips
    home = os.path.realpath(os.path.dirname(os.path.dirname(jar)))  # <home>/jars/spark-core_*.jar
    installed = {os.path.realpath(os.path.join(d, "pyspark")) for d in sys.path
                 if os.path.isfile(os.path.join(d, "pyspark", "__init__.py"))}
    if (os.path.realpath(os.path.join(archive, os.pardir, os.pardir, os.pardir)) != home or home not in installed
            or _package_version(home) != _SPARK_CORE.fullmatch(os.path.basename(jar)).group("version")):
        return
    for entry in (archive, jar):
        sys.path.remove(entry)
        for cached in [k for k in sys.path_importer_cache if k == entry or k.startswith(entry + os.sep)]:
            del sys.path_importer_cache[cached]
        # zipimport's own cache of archive directories (private, hence looked up, not assumed).
        getattr(zipimport, "_zip_directory_cache", {}).pop(entry, None)


def _package_version(home: str) -> str | None:
    """The installed package's version, read from its ``version.py`` without importing it."""
    try:
        with open(os.path.join(home, "version.py"), encoding="utf-8") as source:
            found = _VERSION.search(source.read())
    except (OSError, ValueError):
        return None
    return found.group(1) if found else None


def preload() -> None:
    """Imports PRELOADED, then forgets every oncemore module (the invariant above)."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    forget_oncemore()


def forget_oncemore() -> None:
    for name in [n for n in sys.modules if n == "oncemore" or n.startswith("oncemore.")]:
        del sys.modules[name]


if __name__ == "__main__":
    installed_pyspark_first()
    if os.environ.get(OWN_WORKERS_ENV) == "1":
        forget_oncemore()
    else:
        preload()
    from pyspark import daemon

    daemon.manager()
