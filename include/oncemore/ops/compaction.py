"""Compaction of a table's small files (delta-rs's ``optimize.compact``) that never leaves rows twice
unsaid.

delta-rs 1.6.6's conflict check lets a compaction commit after another writer's compaction (a
delta-spark OPTIMIZE, an overlapping ``oncemore maintain``) removed the same files: both
compacted files then hold their rows. Our compaction's commit (found in the log by a tag in its
commit info) is checked: when a file it removed was already gone at the version before it, it is
undone, on a snapshot only appends reached since, with no retry: its files removed, the files it
removed that were still live added back, the rows as before (a reader in between sees them
twice); the compaction then fails as a conflict, to be run again. When a commit removing files
landed first, nothing can safely undo it any more, and the failure says which version to restore.

Invariant: when ``compact`` returns, the table's live rows are those before it, in fewer files;
when it raises, they are those before it, or the error names the version to restore. A crash
between the racing commit and its undo leaves the rows twice (not detected later).
"""

from __future__ import annotations

import json
import time
import uuid
from urllib.parse import unquote

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from oncemore.core.errors import CommitConflict, OncemoreError
from oncemore.core.storage import filesystem
from oncemore.write.files import logged_partition_values

TAG = "oncemore.compaction"  # in a compaction's commit info: finds its version among others'
UNDO_ATTEMPTS = 3  # snapshots an undo is tried on while appends land


class CompactionRaced(OncemoreError):
    """A compaction committed over another writer's compaction of the same files (their rows twice)
    and could not be undone: the table must be restored to the version before it."""


def compact(table: DeltaTable, target_size: int, where: str, storage_options=None) -> dict:
    """``table`` compacted; delta-rs's metrics (module docstring)."""
    read_version, tag = table.version(), uuid.uuid4().hex
    metrics = table.optimize.compact(target_size=target_size,
                                     commit_properties=CommitProperties(custom_metadata={TAG: tag}))
    if not metrics.get("numFilesRemoved"):  # nothing committed
        return metrics
    version = _tagged(table, read_version, tag, storage_options)
    if version == read_version + 1:  # nothing landed between
        return metrics
    removed, added = _files_of(table.table_uri, version, storage_options)
    before = _live(table.table_uri, read_version, storage_options)
    between = _live(table.table_uri, version - 1, storage_options)
    if not any(p in before and p not in between for p in removed):  # no file it removed was gone already
        return metrics
    if not _undone(table.table_uri, version, added, [between[p] for p in removed if p in between], storage_options):
        raise CompactionRaced(f"{where}: its compaction (version {version}) committed after another writer's compaction "
                              "of the same files, keeping their rows twice, and a commit removing files landed before "
                              f"it could be undone: restore the table to version {version - 1} (the positions go back "
                              "with it: the next run ingests again what the restore takes out)", version=version)
    table.update_incremental()
    raise CommitConflict(f"{where}: another writer compacted the same files meanwhile; this compaction (version "
                         f"{version}) was undone, the rows as before: run it again", table_uri=table.table_uri,
                         version=version)


def _undone(table_uri: str, version: int, added: list[str], removed_live: list[dict], storage_options) -> bool:
    """Whether the compaction at ``version`` was undone (_undo), on the newest snapshot while only
    appends followed it (a commit removing files may have removed ours: then nothing can)."""
    for _ in range(UNDO_ATTEMPTS):
        latest = DeltaTable(table_uri, storage_options=dict(storage_options or {}) or None)
        if any(_files_of(table_uri, v, storage_options)[0] for v in range(version + 1, latest.version() + 1)):
            return False
        try:
            _undo(latest, added, removed_live, version)
            return True
        except CommitFailedError:  # another commit landed first: look again
            continue
    return False


def _tagged(table: DeltaTable, after: int, tag: str, storage_options) -> int:
    """The version after ``after`` whose commit info carries ``tag`` (``table`` is at or past it)."""
    fs, root = filesystem(table.table_uri, storage_options)
    for version in range(after + 1, table.version() + 1):
        with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as stream:
            if any(json.loads(line).get("commitInfo", {}).get(TAG) == tag for line in stream.read().splitlines() if line):
                return version
    raise CompactionRaced(f"{table.table_uri}: the compaction's commit (tag {tag}) is not in the log after version "
                          f"{after}", version=after)


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


def _undo(table: DeltaTable, added: list[str], removed_live: list[dict], version: int) -> None:
    """Commits, on ``table``'s snapshot and nothing later, the removal of
    ``added`` (the racing compaction's files) and the return of ``removed_live`` (the files it
    removed that no other writer had): the rows of the version before it. Statistics come back as the row count and null counts alone (min/max would need the
    columns' types to spell; a later compaction writes them again)."""
    now_ms = int(time.time() * 1000)
    partition_columns = list(table.metadata().partition_columns)
    actions: list = [RemoveAction(unquote(path), False, now_ms) for path in added]
    for add in removed_live:
        stats = json.dumps({"numRecords": add["num_records"], "nullCount": add.get("null_count") or {}})
        values = logged_partition_values(add, partition_columns)
        actions.append(AddAction(unquote(add["path"]), add["size_bytes"], values, add["modification_time"], False,
                                 stats))
    table.create_write_transaction(actions, mode="append", schema=table.schema(), partition_by=partition_columns or None,
                                   commit_properties=CommitProperties(max_commit_retries=0, custom_metadata={
                                       "oncemore.undoes": f"version {version}: a compaction that raced another"}))
