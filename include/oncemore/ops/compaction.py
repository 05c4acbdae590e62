"""Compaction of a table's small files (delta-rs's ``optimize.compact``) that never leaves rows twice.

delta-rs 1.6.6's conflict check lets a compaction commit after another writer's compaction (a
delta-spark OPTIMIZE, an overlapping ``oncemore maintain``) removed the same files: both
compacted files then hold their rows. Such a commit is found from the log (a file it removed was
already gone at the version before it) and undone in the next commit: its files removed, the files
it removed that were still live added back. Between the two commits a reader sees the rows twice.

Invariant: after ``compact`` returns or raises, the table's live rows are those before it (in
fewer files when it returns).
"""

from __future__ import annotations

import json
import time
from urllib.parse import unquote

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction, RemoveAction

from oncemore.core.errors import CommitConflict
from oncemore.core.storage import filesystem
from oncemore.write.files import partition_value_text

ATTEMPTS = 3  # snapshots a compaction is tried on while other writers compact the same files


def compact(table: DeltaTable, target_size: int, where: str, storage_options=None) -> dict:
    """``table`` compacted (its snapshot updated); delta-rs's metrics. CommitConflict when other
    writers' compactions overlapped it ATTEMPTS times (each attempt undone)."""
    for _ in range(ATTEMPTS):
        read_version = table.version()
        metrics = table.optimize.compact(target_size=target_size)
        version = table.version()
        if version in (read_version, read_version + 1):  # nothing committed, or nothing landed between
            return metrics
        removed, added = _files_of(table.table_uri, version, storage_options)
        before = _live(table.table_uri, read_version, storage_options)
        between = _live(table.table_uri, version - 1, storage_options)
        gone = {p for p in removed if p in before and p not in between}  # another writer removed it meanwhile
        if not gone:
            return metrics
        _undo(table, added, [between[p] for p in removed if p in between], where, version)
        table.update_incremental()
    raise CommitConflict(f"{where}: other writers compacted the same files during each of {ATTEMPTS} compactions "
                         "(each undone, the rows as before); run it again", table_uri=table.table_uri)


def _files_of(table_uri: str, version: int, storage_options) -> tuple[list[str], list[str]]:
    """The paths (as the log stores them) commit ``version`` removed and added."""
    fs, root = filesystem(table_uri, storage_options)
    with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as stream:
        actions = [json.loads(line) for line in stream.read().splitlines() if line]
    return ([a["remove"]["path"] for a in actions if "remove" in a], [a["add"]["path"] for a in actions if "add" in a])


def _live(table_uri: str, version: int, storage_options) -> dict[str, dict]:
    """The table's live files at ``version``, by the path the log stores."""
    table = DeltaTable(table_uri, version=version, storage_options=dict(storage_options) if storage_options else None)
    return {add["path"]: add for add in pa.table(table.get_add_actions(flatten=False)).to_pylist()}


def _undo(table: DeltaTable, added: list[str], removed_live: list[dict], where: str, version: int) -> None:
    """Commits the removal of ``added`` (the racing compaction's files) and the return of
    ``removed_live`` (the files it removed that no other writer had): the rows of the version
    before it. Statistics come back as the row count and null counts alone (min/max would need the
    columns' types to spell; a later compaction writes them again)."""
    now_ms = int(time.time() * 1000)
    partition_columns = list(table.metadata().partition_columns)
    actions: list = [RemoveAction(unquote(path), False, now_ms) for path in added]
    for add in removed_live:
        stats = json.dumps({"numRecords": add["num_records"], "nullCount": add.get("null_count") or {}})
        values = {c: partition_value_text((add.get("partition") or {}).get(c)) for c in partition_columns}
        actions.append(AddAction(unquote(add["path"]), add["size_bytes"], values, add["modification_time"], False,
                                 stats))
    table.create_write_transaction(actions, mode="append", schema=table.schema(), partition_by=partition_columns or None,
                                   commit_properties=CommitProperties(custom_metadata={
                                       "oncemore.undoes": f"version {version}: a compaction that raced another"}))
