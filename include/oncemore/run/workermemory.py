"""A Spark Python worker's memory from one task to the next: what a task that reads Kafka runs
under (``task_memory``), and a task's worker without pandas (``pandas_kept_out``).

Invariant: whatever a task did, the worker it leaves behind has Python's cyclic garbage collector
on (a Python worker's default), can import pandas, and holds no more memory than the next task
needs; Spark reuses the worker for the next task.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.abc
import os
import sys
from contextlib import contextmanager
from functools import cache
from typing import Iterator

import pyarrow as pa

from oncemore.run.workerdaemon import OWN_WORKERS_ENV


@contextmanager
def task_memory() -> Iterator[None]:
    """A task's run with Python's cyclic garbage collector paused, and what it freed given back to
    the system when it ends.

    Paused: the Kafka client's messages are objects the collector tracks, so each ``consume()``
    list of 10,000 set off collections that walked every object of the worker; one process read
    and wrote 1 M records at 390,000 records/s with it, 520,000 without (the read alone: 1.45 s
    against 0.85 s). What a task makes is freed by reference counting as before; the rare cycle
    waits for the collector, which is back on (a Python worker's default) when the task ends,
    even if an earlier task's generator was never closed.

    Given back: Spark reuses a Python worker for the next task, and a long run's largest worker
    grew with every batch (560 MiB to 1.2 GB over ten) while nothing was allocated: Arrow's
    jemalloc keeps freed pages, and glibc keeps what the Kafka client's threads freed in their
    arenas. Released after each task, a worker returns to ~220 MiB (measured, 8 tasks of 500,000
    records in one process).

    Allocated by the system's allocator: Arrow's default (mimalloc here) kept more of what a task
    freed while it ran; each task worker of a 1 M-record Avro run peaked 15-35 MiB lower with
    glibc's malloc (docs/performance.md, "Memory beside the peer"). An ``ARROW_DEFAULT_MEMORY_POOL``
    set for the workers wins; a session oncemore starts sets ``system`` for its workers
    (run/session.py): chosen when the worker starts, not at its first task, it kept a 1 M-record
    run's task workers ~20 MiB lower each."""
    _use_system_allocator()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        _release_memory()


@contextmanager
def pandas_kept_out(wanted: bool = True) -> Iterator[None]:
    """Within, pandas cannot be imported, if ``wanted``, this is a worker of a session oncemore
    started (``OWN_WORKERS_ENV``) and pandas was not imported yet; as before once the task ends.

    pyarrow imports pandas on its first conversion of Python or NumPy values (``pa.array``,
    ``to_pylist``, ``to_numpy``), only to recognise pandas objects: refused, it converts without.
    pandas took 44 MiB of each task worker, a third of its imports (a replayed task's imports: 122
    MiB with it, 78 without; docs/performance.md, "Memory beside the peer"). For the tasks of jobs
    where no other Python runs: the ingest job's (run/kafkasource.IngestTasks), and a shaped job's
    (RecordsTasks, run/deltasink.SinkTasks) unless its transform is Python, whose pandas UDFs would
    run in the same workers.

    A later task of the worker imports pandas as usual, but pyarrow, once refused, remembers: until
    a conversion to pandas (``to_pandas``) has it import pandas again, it takes a pandas object
    given to ``pa.array``/``from_pandas`` for a plain sequence (NaN stays NaN, a categorical becomes
    its values, a nullable ``Int64`` Series fails). PySpark's pandas UDFs convert their input with
    ``to_pandas`` first, and ``oncemore run`` runs one pipeline per session (a pipeline with a
    Python transform never keeps pandas out), so no oncemore run meets it; a process that keeps one
    session for other jobs after a run (an embedding application) can, and can unset the variable."""
    keep_out = wanted and os.environ.get(OWN_WORKERS_ENV) == "1" and "pandas" not in sys.modules
    if keep_out:
        sys.meta_path.insert(0, _WITHOUT_PANDAS)
    try:
        yield
    finally:
        if keep_out and _WITHOUT_PANDAS in sys.meta_path:
            sys.meta_path.remove(_WITHOUT_PANDAS)


class _WithoutPandas(importlib.abc.MetaPathFinder):
    """Refuses pandas and its modules as if they were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {name!r} in an oncemore task (run/workermemory.py)",
                                      name=name)
        return None


_WITHOUT_PANDAS = _WithoutPandas()


@cache
def _use_system_allocator() -> None:
    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        pa.set_memory_pool(pa.system_memory_pool())


def _release_memory() -> None:
    pa.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS) or the process's
    own symbols cannot be opened (Windows): releasing is hygiene, and must never fail a task."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim
