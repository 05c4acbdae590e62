"""A task runs with Python's cyclic collector paused and leaves its worker with it on (run/workermemory.py)."""

import gc
from types import SimpleNamespace

import pyarrow as pa
import pytest

from oncemore.run import workermemory
from oncemore.run.tasks import decode_ranges, ingest_ranges
from oncemore.run.workermemory import task_memory


@pytest.fixture(autouse=True)
def collector_on_after():
    yield
    gc.enable()  # a failed assertion must not leave this test process without its collector


@pytest.mark.parametrize("task", [ingest_ranges, decode_ranges])
def test_both_kinds_of_task_read_their_ranges_with_the_collector_paused(task):
    seen = []

    def ranges():  # read by the task: records the collector's state then
        seen.append(gc.isenabled())
        yield from ()

    # A task with no range to read: TaskFiles asks the spec for its shared writers, and has none to close.
    spec = SimpleNamespace(writers=lambda: {})
    assert list(task(ranges(), spec, None, {})) == []
    assert seen == [False] and gc.isenabled()


def test_a_task_runs_with_the_collector_paused_and_leaves_it_on_however_it_ends():
    with task_memory():
        assert not gc.isenabled()
    assert gc.isenabled()

    with pytest.raises(RuntimeError), task_memory():
        raise RuntimeError("the task failed")
    assert gc.isenabled()

    # An earlier task's generator that was never closed left the collector off: the next task
    # still leaves the worker with it on.
    abandoned = iter_in_task()
    next(abandoned)
    assert not gc.isenabled()
    with task_memory():
        pass
    assert gc.isenabled()
    abandoned.close()
    assert gc.isenabled()


def iter_in_task():
    with task_memory():
        yield


@pytest.fixture
def arrow_pool():
    """Arrow's default pool as this process had it, restored after the test (a task sets it)."""
    before = pa.default_memory_pool()
    workermemory._use_system_allocator.cache_clear()
    yield
    pa.set_memory_pool(before)
    workermemory._use_system_allocator.cache_clear()


def test_a_task_allocates_arrow_memory_with_the_system_allocator(arrow_pool, monkeypatch):
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    pa.set_memory_pool(pa.mimalloc_memory_pool())  # Arrow's own default on these wheels
    with task_memory():
        assert pa.default_memory_pool().backend_name == "system"
        assert pa.array(range(1000)).to_pylist()[-1] == 999  # allocated there
    assert pa.default_memory_pool().backend_name == "system"  # the worker's next task too


def test_an_allocator_set_for_the_workers_wins(arrow_pool, monkeypatch):
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "mimalloc")
    pa.set_memory_pool(pa.mimalloc_memory_pool())  # what Arrow chose from the variable
    with task_memory():
        assert pa.default_memory_pool().backend_name == "mimalloc"
