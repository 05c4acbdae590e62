"""A task runs with Python's cyclic collector paused and leaves its worker with it on, and an ingest
task of a session oncemore started runs without pandas (run/workermemory.py)."""

import gc
import os
import subprocess
import sys
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


# Run in a fresh interpreter: this test process has imported pandas already.
WITHOUT_PANDAS = """
import sys
import pyarrow as pa
from oncemore.run.workermemory import pandas_kept_out
with pandas_kept_out():
    assert pa.array([1, None]).to_pylist() == [1, None]  # pyarrow's first conversion asks for pandas
    assert pa.array([3], pa.int32()).to_numpy(zero_copy_only=False).tolist() == [3]
    try:
        import pandas
        print("imported inside")
    except ModuleNotFoundError as refused:
        print("refused:", refused)
    print("pandas" in sys.modules)
import pandas  # the worker's next task
print(pa.table({"x": [1, 2]}).to_pandas()["x"].tolist())
# to_pandas had pyarrow import pandas: it recognises pandas objects again (a nullable Int64 Series
# failed as a plain sequence while it remembered the refusal).
print(pa.array(pandas.Series([1, None], dtype="Int64")).to_pylist())
"""


@pytest.mark.parametrize("own", [True, False])
def test_an_ingest_task_of_oncemore_s_own_workers_converts_arrow_without_pandas_and_leaves_it_importable(own):
    env = {k: v for k, v in os.environ.items() if k != workermemory.OWN_WORKERS_ENV}
    if own:
        env[workermemory.OWN_WORKERS_ENV] = "1"
    out = subprocess.run([sys.executable, "-c", WITHOUT_PANDAS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    if own:
        assert lines[:2] == ["refused: No module named 'pandas' in an oncemore task (run/workermemory.py)",
                             "False"]
    else:  # a worker of another session (a Connect server's) keeps pandas
        assert lines[:2] == ["imported inside", "True"]
    assert lines[2:] == ["[1, 2]", "[1, None]"]


def test_the_workers_of_a_session_oncemore_starts_get_its_worker_environment(spark):
    from oncemore.run.session import WORKER_ENV

    def report(batches):  # in a worker: its environment
        for _ in batches:
            pass
        yield pa.record_batch([pa.array([" ".join(f"{k}={os.environ.get(k)}" for k in sorted(WORKER_ENV))])],
                              names=["env"])

    seen = {row.env for row in spark.range(0, 2, 1, 2).mapInArrow(report, "env string").collect()}
    # Each as this process's environment sets it (the fixture's session was started from it), else oncemore's.
    assert seen == {" ".join(f"{k}={os.environ.get(k, WORKER_ENV[k])}" for k in sorted(WORKER_ENV))}
    assert WORKER_ENV == {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2", "ONCEMORE_OWN_WORKERS": "1"}
