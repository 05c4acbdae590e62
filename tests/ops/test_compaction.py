"""Compaction that never leaves rows twice: a compaction committed after another writer's compaction
of the same files (delta-rs 1.6.6 lets it through) is undone, the rows as before, counted."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from oncemore.ops import compaction
from oncemore.ops.compaction import compact


def ids(path) -> list[int]:
    return sorted(r["id"] for r in DeltaTable(path).to_pyarrow_table().to_pylist())


def small_files(path, days: list[date], per_day: int = 3) -> None:
    for i in range(per_day * len(days)):
        write_deltalake(path, pa.table({"id": [i], "day": [days[i % len(days)]]}), partition_by=["day"], mode="append")


def operations(path) -> list[str]:
    return [json.loads(line)["commitInfo"].get("operation", "") for f in sorted(Path(path, "_delta_log").glob("*.json"))
            for line in f.read_text().splitlines() if '"commitInfo"' in line]


def test_a_compaction_on_a_snapshot_another_writer_compacted_since_is_undone_and_the_rows_stay_once(tmp_path):
    path = str(tmp_path / "t")
    small_files(path, [date(2026, 1, 1), date(2026, 1, 2)])
    ours = DeltaTable(path)  # read before the other writer's compaction
    DeltaTable(path).optimize.compact(partition_filters=[("day", "=", "2026-01-01")])  # the other writer: one day
    # Unguarded, delta-rs commits ours too: the first day's rows in both compacted files.
    assert compaction.ATTEMPTS > 1
    metrics = compact(ours, 1 << 30, "pipeline p: maintain: main table")
    assert ids(path) == list(range(6))
    # The other writer's, ours, its undo (ours removed, the second day's files back), the next attempt's.
    assert operations(path)[6:] == ["OPTIMIZE", "OPTIMIZE", "WRITE", "OPTIMIZE"]
    assert metrics["numFilesRemoved"] == 3  # the next attempt compacted the second day alone
    files = pa.table(DeltaTable(path).get_add_actions(flatten=False)).to_pylist()
    assert sorted(f["num_records"] for f in files) == [3, 3]


def test_an_append_landing_during_a_compaction_is_no_race_and_stays(tmp_path):
    path = str(tmp_path / "t")
    small_files(path, [date(2026, 1, 1)])
    ours = DeltaTable(path)
    write_deltalake(path, pa.table({"id": [9], "day": [date(2026, 1, 1)]}), partition_by=["day"], mode="append")
    metrics = compact(ours, 1 << 30, "pipeline p: maintain: main table")
    assert metrics["numFilesRemoved"] == 3 and ids(path) == [0, 1, 2, 9]
    assert operations(path)[-1] == "OPTIMIZE" and operations(path).count("WRITE") == 4  # the appends alone
