"""A task runs with Python's cyclic collector paused and leaves its worker with it on (taskmemory.py)."""

import gc

import pytest

from oncemore.taskmemory import task_memory


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
