"""A Spark Python worker's memory from one task to the next: what a task that reads Kafka runs
under (``task_memory``).

Invariant: whatever a task did, the worker it leaves behind has Python's cyclic garbage collector
on (a Python worker's default) and holds no more memory than the next task needs; Spark reuses the
worker for the next task.
"""

from __future__ import annotations

import ctypes
import gc
import os
from contextlib import contextmanager
from functools import cache
from typing import Iterator

import pyarrow as pa


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
    set for the workers wins."""
    _use_system_allocator()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        _release_memory()


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
