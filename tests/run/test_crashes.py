"""A run, or a maintenance, SIGKILLed at each step core/crashpoints.py names: what the crash leaves is what
that step says, and from there a rerun alone and two reruns racing each end exact, counted by
(topic, partition, offset) and confirmed by ``oncemore verify``."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from conftest import (
    assert_exactly_once,
    committed_offsets,
    oncemore_command,
    oncemore_commits,
    orders,
    produced_coordinates,
    read_coordinates,
)
from oncemore.ops.maintain import maintain
from oncemore.report.verify import verify
from oncemore.run import runner

pytestmark = pytest.mark.spark

# (step, the path the records take, oncemore commits in (main, quarantine) right after the crash)
RUN_STEPS = [
    ("planned", "fused", (0, 0)),
    ("written", "fused", (0, 0)),
    ("validated", "fused", (0, 0)),
    ("quarantine_committed", "fused", (0, 1)),
    ("main_committed", "fused", (1, 1)),
    ("mirrored", "fused", (1, 1)),
    ("written", "shaped", (0, 0)),
    ("validated", "shaped", (0, 0)),
    ("quarantine_committed", "shaped", (0, 1)),
    ("main_committed", "shaped", (1, 1)),
]


def broken_orders(count: int) -> list:
    """Orders over three partitions, one in 25 malformed (quarantined), the first among them in batch 0."""
    return [(p, k, b"{broken" if i % 25 == 3 else v, h) for i, (p, k, v, h) in enumerate(orders(0, count))]


def commit_counts(pipeline) -> tuple[int, int]:
    return tuple(len(oncemore_commits(uri)) if DeltaTable.is_deltatable(uri) else 0
                 for uri in (pipeline.sink.table_uri, pipeline.sink.quarantine_uri))


def assert_exact(pipeline, produced, spark) -> None:
    """Counted: every produced record once in the main table or the quarantine, none else; and
    ``oncemore verify`` agrees from the tables alone."""
    landed = read_coordinates(pipeline.sink.table_uri) + read_coordinates(pipeline.sink.quarantine_uri)
    assert_exactly_once(landed, produced)
    report = verify(pipeline, lambda: spark)
    assert report.ok, report.discrepancies[:5]


def race(pipeline, command: str = "run") -> list[tuple[int, str, str]]:
    racers = [oncemore_command(pipeline, command) for _ in range(2)]
    outputs = [r.communicate(timeout=600) for r in racers]
    return [(r.returncode, *output) for r, output in zip(racers, outputs)]


def crashed(pipeline, step: str, expected: tuple[int, int]) -> None:
    """Runs the pipeline dying at ``step``: the whole run is gone (its JVM and Python workers too),
    and what it left is what that step says."""
    process = oncemore_command(pipeline, "run", step)
    _, err = process.communicate(timeout=600)
    assert process.returncode == -signal.SIGKILL, err[-2000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"a process of the run killed at {step} survived it")
    assert commit_counts(pipeline) == expected
    table = Path(pipeline.sink.table_uri)
    if step == "planned":  # before the tables are made ready
        assert not table.exists()
    elif step in ("written", "validated"):  # its files written, none referenced
        on_disk = {p.name for p in table.rglob("*.parquet")}
        assert on_disk and not on_disk & {Path(uri).name for uri in DeltaTable(str(table)).file_uris()}


@pytest.mark.parametrize("step,path,expected", RUN_STEPS, ids=[f"{s}-{p}" for s, p, _ in RUN_STEPS])
def test_a_run_killed_at_each_step_ends_exact_on_a_rerun_and_on_two_racing_reruns(
        step, path, expected, broker, topic, make_pipeline, spark):
    produced = produced_coordinates(topic, broker.produce(topic, broken_orders(300)))
    shaping = {"transform": "SELECT * FROM records WHERE id IS NOT NULL"} if path == "shaped" else {}
    settings = dict(limits={"max_records_per_commit": 150}, commit_consumer_group=True, **shaping)
    alone, racing = (make_pipeline(topic, name=name, **settings) for name in ("alone", "racing"))

    crashed(alone, step, expected)
    if step == "mirrored":  # batch 0 mirrored, batch 1 not begun
        assert committed_offsets(broker, alone) == {p: 50 for p in (0, 1, 2)}
    elif step == "main_committed":
        assert all(offset < 0 for offset in committed_offsets(broker, alone).values())  # none mirrored yet
    assert runner.run(alone, spark_factory=lambda: spark).status == "committed"
    assert_exact(alone, produced, spark)
    assert committed_offsets(broker, alone) == {p: 100 for p in (0, 1, 2)}

    crashed(racing, step, expected)
    results = race(racing)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert_exact(racing, produced, spark)
    # Each batch committed once to each table, whichever racer made it.
    assert commit_counts(racing) == (2, 2)


def test_a_rerun_under_another_format_than_the_crashed_part_judged_its_records_by_is_refused(
        broker, topic, make_pipeline, spark):
    from oncemore.core.errors import JudgingChanged

    produced = produced_coordinates(topic, broker.produce(topic, broken_orders(300)))
    pipeline = make_pipeline(topic, name="judged", limits={"max_records_per_commit": 150})
    crashed(pipeline, "quarantine_committed", (0, 1))
    # The part's malformed records are in the quarantine table, its others wait for the main commit:
    # a stricter schema would refuse them below the quarantine table's floor (lost), a looser one
    # take the quarantined ones as rows (twice).
    stricter = make_pipeline(topic, name="judged", limits={"max_records_per_commit": 150},
                             format={"type": "json", "schema": "id BIGINT, customer STRING, amount BIGINT"})
    with pytest.raises(JudgingChanged) as refused:
        runner.run(stricter, spark_factory=lambda: spark)
    line = str(refused.value)
    assert "\n" not in line and f"topic {topic} partition 0 offsets [0, 50) were judged" in line, line
    assert "restore them and run once" in line, line
    restored = make_pipeline(topic, name="judged", limits={"max_records_per_commit": 150})
    assert runner.run(restored, spark_factory=lambda: spark).status == "committed"
    assert_exact(restored, produced, spark)


@pytest.mark.parametrize("step", ["compacted", "checkpointed"])
def test_maintenance_killed_at_each_step_ends_exact_on_a_rerun_and_on_two_racing_reruns(
        step, broker, topic, make_pipeline, spark):
    produced = produced_coordinates(topic, broker.produce(topic, broken_orders(300)))
    pipeline = make_pipeline(topic, limits={"max_records_per_commit": 60})
    runner.run(pipeline, spark_factory=lambda: spark)
    before = DeltaTable(pipeline.sink.table_uri)
    files, version = len(before.file_uris()), before.version()
    assert files >= 5

    killed = oncemore_command(pipeline, "maintain", step)
    killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL
    after = DeltaTable(pipeline.sink.table_uri)
    assert after.version() == version + 1 and len(after.file_uris()) < files  # compaction landed
    checkpoint = Path(pipeline.sink.table_uri, "_delta_log", f"{after.version():020d}.checkpoint.parquet")
    assert checkpoint.exists() == (step == "checkpointed")
    assert_exact(pipeline, produced, spark)

    maintain(pipeline)
    assert_exact(pipeline, produced, spark)
    results = race(pipeline, "maintain")
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    more = produced_coordinates(topic, broker.produce(topic, orders(300, 90)))
    runner.run(pipeline, spark_factory=lambda: spark)
    assert_exact(pipeline, produced + more, spark)
