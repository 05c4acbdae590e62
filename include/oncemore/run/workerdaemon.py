"""The Python worker daemon of a resident Spark (the Connect server: ``spark.python.daemon.module=
oncemore.run.workerdaemon``): PySpark's own daemon, which forks a Python worker per task slot, with
the libraries every oncemore task imports already loaded, so a forked worker inherits them.

Spark stops a Python worker after a minute idle (a fixed interval in its PythonWorkerFactory), so
every hourly run on a warm server started new workers, and each paid these imports again: pandas
alone, which pyarrow imports on the first ``pa.array``, took 0.2-0.3 s of a task's first read
(measured, benchmarks/fixed_cost.py "after idle").

Invariant: no oncemore module stays loaded in the daemon. A worker imports oncemore from what its
client session shipped (the package zip, an artifact), never from the server's own copy, whatever
version either is: ``python -m`` imported the package to run this module, and it is forgotten
before the first fork.

Forking after these imports is safe. PySpark's own daemon imports after the fork because it cannot
know what a worker imports, and some libraries start threads. Of these, numpy's OpenBLAS starts
none under the OMP_NUM_THREADS=1 Spark gives its workers' daemon. Arrow starts jemalloc's
background thread, which jemalloc's own fork handlers re-create in a child when needed. Measured:
the daemon holds those two threads, each forked worker one.
"""

from __future__ import annotations

import sys

# What a task of each oncemore source imports whatever the pipeline's formats (tasks, records,
# the json decoder, the file writer), and PySpark's worker, which its daemon would import in every fork.
PRELOADED = ("pyspark.worker", "numpy", "pandas", "pyarrow", "pyarrow.compute", "pyarrow.fs", "pyarrow.json",
             "pyarrow.parquet", "confluent_kafka")


def preload() -> None:
    """Imports PRELOADED, then forgets every oncemore module (the invariant above)."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    for name in [n for n in sys.modules if n == "oncemore" or n.startswith("oncemore.")]:
        del sys.modules[name]


if __name__ == "__main__":
    preload()
    from pyspark import daemon

    daemon.manager()
