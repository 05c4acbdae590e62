"""Compaction that never leaves rows twice: a compaction committed after another writer's compaction
of the same files (delta-rs 1.6.6 lets it through) is undone, the rows as before, counted."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from oncemore.core.errors import CommitConflict
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
    with pytest.raises(CommitConflict, match=r"^pipeline p: maintain: main table: another writer compacted the same "
                                             r"files meanwhile; this compaction \(version 7\) was undone"):
        compact(ours, 1 << 30, "pipeline p: maintain: main table")
    assert ids(path) == list(range(6))
    # The other writer's, ours, its undo (ours removed, the second day's files back).
    assert operations(path)[6:] == ["OPTIMIZE", "OPTIMIZE", "WRITE"]
    assert compact(DeltaTable(path), 1 << 30, "again")["numFilesRemoved"] == 3  # run again: the second day
    files = pa.table(DeltaTable(path).get_add_actions(flatten=False)).to_pylist()
    assert sorted(f["num_records"] for f in files) == [3, 3] and ids(path) == list(range(6))


def raced(tmp_path) -> tuple[str, DeltaTable]:
    """A table of small files, a snapshot of it, and the other writer's compaction since."""
    path = str(tmp_path / "t")
    small_files(path, [date(2026, 1, 1)])
    ours = DeltaTable(path)
    DeltaTable(path).optimize.compact()
    return path, ours


def append(path, id_: int) -> None:
    write_deltalake(path, pa.table({"id": [id_], "day": [date(2026, 1, 1)]}), partition_by=["day"], mode="append")


def test_an_append_landing_right_after_a_racing_compaction_does_not_hide_it(tmp_path, monkeypatch):
    """delta-rs's compact reads the table again after its commit: the newest version is the append's."""
    path, ours = raced(tmp_path)
    reread = ours.update_incremental

    def append_then_reread():
        append(path, 99)
        monkeypatch.setattr(ours, "update_incremental", reread)
        reread()

    monkeypatch.setattr(ours, "update_incremental", append_then_reread)
    with pytest.raises(CommitConflict, match="was undone"):
        compact(ours, 1 << 30, "pipeline p: maintain: main table")
    assert ids(path) == [0, 1, 2, 99]


def test_a_racing_compaction_a_later_compaction_reached_first_names_the_version_to_restore(tmp_path, monkeypatch):
    path, ours = raced(tmp_path)
    found = compaction._files_of

    def another_compaction_first(*args):  # lands between ours and its undo, removing our file
        append(path, 99)
        DeltaTable(path).optimize.compact()
        monkeypatch.setattr(compaction, "_files_of", found)
        return found(*args)

    monkeypatch.setattr(compaction, "_files_of", another_compaction_first)
    with pytest.raises(compaction.CompactionRaced, match=r"^pipeline p: maintain: main table: its compaction "
                                                         r"\(version 4\) .* restore the table to version 3 "):
        compact(ours, 1 << 30, "pipeline p: maintain: main table")
    DeltaTable(path).restore(3)
    assert ids(path) == [0, 1, 2]


def test_an_append_landing_during_a_compaction_is_no_race_and_stays(tmp_path):
    path = str(tmp_path / "t")
    small_files(path, [date(2026, 1, 1)])
    ours = DeltaTable(path)
    append(path, 9)
    metrics = compact(ours, 1 << 30, "pipeline p: maintain: main table")
    assert metrics["numFilesRemoved"] == 3 and ids(path) == [0, 1, 2, 9]  # no race: kept
    assert operations(path)[-1] == "OPTIMIZE" and operations(path).count("WRITE") == 4  # the appends alone
