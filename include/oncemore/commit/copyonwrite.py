"""An upsert part's main commit when its MERGE runs on the cluster (``upsert.merge: cluster``):
copy-on-write of the files holding a changed key, rewritten by the cluster's tasks, committed by
delta-rs in ONE commit of their removes, the new files' adds, the txn actions and the record.

The table is scanned once, by the cluster's tasks (write/keyscan.py: each a share of the live
files' row groups, the key and order columns only, joined with the part's keys staged as Parquet
in the part's staging area); the driver reads back only the matching rows, with the index of the
file holding each. Each file's rows read must add up to its add action's record count (a short
read refuses the part), and a key on two rows of the table is refused. Those matches are the
table's rows merge.py classifies the events against, and they locate the files holding a changed
key: each changing key found is an update or a delete, each not found an insert, and these must be
the classification's counts before anything is written. The part of the change rows each rewrite
task needs is staged as Parquet in the part's staging area, so no change row travels through
Spark. Each task (write/rewrite.py) rewrites its files without the changed keys' rows and adds the
upserts; each task's rows must add up (rows read - rows dropped + rows added = rows written, the
rows dropped are exactly the keys located in its files, the rows added its staged upserts) and the
new files be whole, or nothing is committed (all this runs before the part's tombstones commit)
and the new files are deleted. A touched file whose log path another
writer spelled otherwise than delta-rs spells a remove's is refused before anything is written
(removable.py: its remove would not cancel its add), and after the commit no removed file may be live (paths
compared decoded). The commit lands on the snapshot the part was
classified on or not at all (no retry): delta-rs's conflict check lets a commit remove a file a
concurrent commit removed already (an OPTIMIZE, a racing run; delta-rs 1.6.6), which would keep
both the compacted rows and their rewrite. Any commit that landed meanwhile refuses it, judged as
any refused commit (committer.refused_commit: a racing run that committed the range won the
race; otherwise a conflict, and the next run goes on); after an attempt the new files are never
deleted (vacuum removes those of a commit that did not land).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Mapping
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from oncemore.commit.committer import (CommitOutcome, commit, delete_files, properties, refused_commit,
                                       validate_files, version_of)
from oncemore.commit.removable import SPELLED, WAY_OUT, UnremovableFile, delta_rs_spelling
from oncemore.core import crashpoints
from oncemore.core.columns import CHANGE_COLUMN, schema_text
from oncemore.core.errors import InvalidDataFile, OncemoreError
from oncemore.core.storage import filesystem
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.write.files import DataFile, logged_partition_values
from oncemore.write.keyscan import FILE_COLUMN, FileSlice, ScanResult, ScanTask, matches_schema
from oncemore.write.rewrite import RewriteResult, RewriteTask, TouchedFile

log = logging.getLogger("oncemore")

SCAN_TASK_BYTES = 4 << 30  # live files' bytes per key-scan task at most, beyond one per slot: it streams their keys and order
TASK_BYTES = 1 << 30  # touched files' bytes per task at most, beyond one per slot: its wall time, not its memory (it streams)
INSERT_ROWS_PER_TASK = 1_000_000  # inserts per task when no file is touched


class RewriteMiscount(OncemoreError):
    """The cluster's rewrite of an upsert part does not add up: the MERGE commits nothing."""


class ScanMiscount(OncemoreError):
    """The cluster's key scan of an upsert part did not read every row of the table's live files:
    nothing is classified, nothing committed."""


class RemoveMissed(OncemoreError):
    """A cluster MERGE's commit left a file it removed live in the table: a key is on two rows."""


NOTHING = "nothing was committed to the table or its tombstones table"  # a refusal comes before both commits
UNREMOVABLE = f"file {{path}} holds a changed key, and {SPELLED}: the MERGE would leave it live beside its rewrite"


@dataclass(frozen=True)
class ClusterRewrite:
    """How the run rewrites on its cluster: ``run`` executes the rewrite tasks and ``scan`` the
    key-scan tasks (run/rewritejob.py), each returning one result per task, in the tasks' order;
    ``staging_uri``: where the part's keys and tasks' change rows are staged (in the part's staging area, removed with it)."""

    run: Callable[[list[RewriteTask]], list[RewriteResult]]
    scan: Callable[[list[ScanTask]], list[ScanResult]]
    staging_uri: str
    storage_options: Mapping[str, str] | None = None
    slots: int = 1  # tasks the cluster runs at once: the touched files are spread over at least as many


@dataclass(frozen=True)
class Scanned:
    """The cluster's key scan of a snapshot: ``rows``, the table's rows holding a key of the part
    (its keys, the order columns asked for, FILE_COLUMN); ``adds``, the snapshot's live files (their
    add actions) FILE_COLUMN indexes, and their partition values as text."""

    rows: pa.Table
    adds: list[dict]
    values: list[dict[str, str | None]]


@dataclass(frozen=True)
class Rewritten:
    """A part's copy-on-write done and checked, not committed: the files it removes and adds,
    the MERGE's metrics as delta-rs names them."""

    touched: list[TouchedFile]
    files: list[DataFile]
    metrics: dict


def part_of(pipeline: str, record: CommitInfo) -> str:
    """The part in the words of a refusal: pipeline, topics, partitions and offsets."""
    ranges = ", ".join(f"{p} offsets [{s}, {e})" for p, (s, e) in sorted(record.partition_ranges().items()))
    return f"pipeline {pipeline} ({ranges or 'no range'})"


def rewrite_part(table: DeltaTable, changing: pa.Table, keys: tuple[str, ...], cluster: ClusterRewrite,
                 scanned: Scanned, counts: Mapping[str, int], where: str, pipeline: str) -> Rewritten:
    """The part's ``changing`` rows applied to ``table`` (the snapshot merge.py classified them
    on, with ``scanned``: scan_keys of their keys) by copy-on-write on the cluster, checked,
    before any commit of the part (module docstring); none of it is committed yet."""
    if not changing.num_rows:  # no event changes a row: the positions alone
        return Rewritten([], [], {})
    began = time.perf_counter()
    touched, owner = locate(scanned, changing, keys, where)
    located = time.perf_counter()
    upserts = pc.equal(changing.column(CHANGE_COLUMN), "upsert")
    held_key = pc.greater_equal(owner, 0)
    metrics = {"num_target_rows_inserted": pc.sum(pc.and_(upserts, pc.invert(held_key))).as_py() or 0,
               "num_target_rows_updated": pc.sum(pc.and_(upserts, held_key)).as_py() or 0,
               "num_target_rows_deleted": pc.sum(pc.and_(pc.invert(upserts), held_key)).as_py() or 0}
    said = {k: counts[k] for k in ("inserted", "updated", "deleted")}
    found = {k: metrics[f"num_target_rows_{k}"] for k in said}
    if found != said:
        raise RewriteMiscount(f"{where}: the table's files hold keys for {found}, the events said {said}; {NOTHING}",
                              found=found, said=said)
    tasks, staged_upserts = _tasks(table, changing, keys, touched, owner, cluster)
    staged = time.perf_counter()
    results = cluster.run(tasks)
    rewritten = time.perf_counter()
    files = [f for r in results for f in r.files]
    crashpoints.reach("rewritten")
    _check(results, tasks, staged_upserts, said["inserted"] + said["updated"], files, table, where, cluster)
    metrics.update(num_target_files_removed=len(touched), num_target_files_added=len(files))
    log.info("pipeline %s: the cluster MERGE located %d touched files in %.1fs, staged %d tasks' change rows in %.1fs, "
             "rewrote in the Spark job %d rows read, %d dropped, %d added into %d files in %.1fs",
             pipeline, len(touched), located - began, len(tasks), staged - located, *(sum(getattr(r, n) for r in results)
             for n in ("read", "dropped", "added")), len(files), rewritten - staged)
    return Rewritten(touched, files, metrics)


def commit_rewrite(ledger: Ledger, table: DeltaTable, done: Rewritten, expected, new_positions, partitions,
                   record: CommitInfo, pipeline: str) -> tuple[CommitOutcome, dict]:
    """``done``'s removes and adds with the positions, in one commit on ``table``'s version or
    none (module docstring); returns the outcome and the MERGE's metrics."""
    if not done.metrics:
        return commit(ledger, [], expected, new_positions, partitions, record), {}
    now_ms = int(time.time() * 1000)
    actions = [RemoveAction(t.path, True, now_ms, t.size, dict(t.partition_values)) for t in done.touched]
    actions += [AddAction(f.path, f.size, json.loads(f.partition_values), now_ms, True, f.stats) for f in done.files]
    read_version = table.version()
    began = time.perf_counter()
    try:
        table.create_write_transaction(actions, mode="append", schema=table.schema(),
                                       partition_by=list(table.metadata().partition_columns) or None,
                                       commit_properties=properties(ledger, table, new_positions, partitions, record,
                                                                    retries=0))
    except CommitFailedError as exc:
        return refused_commit(ledger, exc, record, read_version, expected, new_positions), {}
    outcome = CommitOutcome("committed", version_of(ledger, record, read_version))
    _removed(ledger, done.touched, outcome.version, f"{part_of(pipeline, record)}: {ledger.table_uri}")
    log.info("pipeline %s: the cluster MERGE committed version %s in %.1fs", pipeline, outcome.version,
             time.perf_counter() - began)
    return outcome, done.metrics


def _removed(ledger: Ledger, touched: list[TouchedFile], version: int | None, where: str) -> None:
    """No file the commit removed is live at its version, paths compared decoded (delta-rs and
    other writers escape them differently)."""
    live = {unquote(p) for p in pa.table(DeltaTable(ledger.table_uri, version=version,
                                                    storage_options=dict(ledger.storage_options or {}) or None)
                                         .get_add_actions(flatten=False)).column("path").to_pylist()}
    left = sorted(unquote(t.path) for t in touched if unquote(t.path) in live)
    if left:
        raise RemoveMissed(f"{where} version {version}: the cluster MERGE's commit left {left[0]} live with its "
                           "rewrite (keys on two rows): restore the version before it, then compact the table (oncemore "
                           "maintain) before the next run", version=version, path=left[0])


def scan_keys(table: DeltaTable, probe: pa.Table, keys: tuple[str, ...], columns: list[str], cluster: ClusterRewrite,
              where: str) -> Scanned:
    """The rows of ``table`` (the snapshot the part is classified on) holding a key of ``probe``:
    their keys and ``columns`` (the table's types), found by the cluster's scan tasks
    (write/keyscan.py), checked (module docstring); a key on two rows of the table is refused."""
    adds = pa.table(table.get_add_actions(flatten=False)).to_pylist()
    partition_columns = list(table.metadata().partition_columns)
    values = [logged_partition_values(add, partition_columns) for add in adds]
    schema = pa.schema(table.schema().to_arrow())
    shape = matches_schema(schema, keys, tuple(columns))
    if not probe.num_rows or not adds:
        return Scanned(shape.empty_table(), adds, values)
    fs, root = filesystem(cluster.staging_uri, cluster.storage_options)
    fs.create_dir(root, recursive=True)
    name = f"keys-{uuid.uuid4().hex}.parquet"
    pq.write_table(probe.select(list(keys)).cast(pa.schema([schema.field(k) for k in keys])), f"{root}/{name}",
                   filesystem=fs)
    tasks = _scan_tasks(table, adds, values, keys, columns, f"{cluster.staging_uri.rstrip('/')}/{name}", cluster)
    began = time.perf_counter()
    results = cluster.scan(tasks)
    found = _scan_checked(results, tasks, adds, shape, where, cluster)
    twice = found.select(list(keys)).group_by(list(keys)).aggregate([([], "count_all")])
    twice = twice.filter(pc.greater(twice.column("count_all"), 1))
    if twice.num_rows:
        key = twice.select(list(keys)).slice(0, 1).to_pylist()[0]
        raise RewriteMiscount(f"{where}: key {json.dumps(key, default=str)} is on two rows of the table; {NOTHING}; "
                              "remove one (oncemore delete --where on the key and its _kafka_offset), then run again",
                              key=str(key))
    log.info("%s: the cluster MERGE scanned the keys of %d files in %d tasks in %.1fs: %d rows read, %d of the "
             "part's %d keys found", where, len(adds), len(tasks), time.perf_counter() - began,
             sum(s.read for r in results for s in r.slices), found.num_rows, probe.num_rows)
    return Scanned(found, adds, values)


def _scan_tasks(table: DeltaTable, adds: list[dict], values: list[dict], keys: tuple[str, ...], columns: list[str],
                keys_path: str, cluster: ClusterRewrite) -> list[ScanTask]:
    """The live files spread over the cluster's slots, or more tasks of about SCAN_TASK_BYTES
    each: a file larger than a task's share split into slices of its row groups, the largest
    slice first, to the task holding the fewest bytes."""
    total = sum(add["size_bytes"] for add in adds)
    share = max(1, -(-total // max(cluster.slots, -(-total // SCAN_TASK_BYTES))))  # a task's bytes
    slices = [(add["size_bytes"] / parts, FileSlice(index, unquote(add["path"]), values[index], part, parts))
              for index, add in enumerate(adds) for parts in [max(1, -(-add["size_bytes"] // share))]
              for part in range(parts)]
    groups: list[list[FileSlice]] = [[] for _ in range(min(len(slices), max(cluster.slots, -(-total // share))))]
    sizes = [0.0] * len(groups)
    for size, piece in sorted(slices, key=lambda s: -s[0]):
        smallest = sizes.index(min(sizes))
        groups[smallest].append(piece)
        sizes[smallest] += size
    text = schema_text(pa.schema(table.schema().to_arrow()))
    return [ScanTask(table.table_uri, text, keys, tuple(columns), keys_path, cluster.staging_uri, tuple(group))
            for group in groups]


def _scan_checked(results: list[ScanResult], tasks: list[ScanTask], adds: list[dict], shape: pa.Schema, where: str,
                  cluster: ClusterRewrite) -> pa.Table:
    """The scan tasks' matches, once every task reported, each slice it was given once, and the
    rows read of each file add up to its add action's record count (its footer's where the log
    has no statistics), its matches only from its own files; else the part is refused."""
    problems = [] if len(results) == len(tasks) else [f"{len(results)} of {len(tasks)} tasks reported"]
    read: dict[int, int] = {}
    footer: dict[int, set[int]] = {}
    found = []
    for number, (task, result) in enumerate(zip(tasks, results)):
        if sorted((s.file, s.part) for s in result.slices) != sorted((s.file, s.part) for s in task.slices):
            problems.append(f"task {number} reported other slices than it was given")
        for piece in result.slices:
            read[piece.file] = read.get(piece.file, 0) + piece.read
            footer.setdefault(piece.file, set()).add(piece.rows)
        rows = shape.empty_table()
        if result.found_path:
            fs, path = filesystem(result.found_path, cluster.storage_options)
            rows = pq.read_table(path, filesystem=fs)
        files, given = set(pc.unique(rows.column(FILE_COLUMN)).to_pylist()), {s.file for s in task.slices}
        if rows.num_rows != result.found or not files <= given:
            problems.append(f"task {number} staged {rows.num_rows} matches (reported {result.found}) of files "
                            f"{sorted(files)}, given {sorted(given)}")
        found.append(rows.select(shape.names).cast(shape))
    for index, add in enumerate(adds):
        records = add.get("num_records")
        expected = records if records is not None else min(footer.get(index, {-1}))
        if read.get(index) != expected or footer.get(index, {expected}) != {expected}:
            problems.append(f"file {unquote(add['path'])}: read {read.get(index, 0)} of its {expected} rows")
    if problems:
        raise ScanMiscount(f"{where}: the cluster's key scan of {len(adds)} files in {len(tasks)} tasks does not add up "
                           f"({'; '.join(problems[:3])}{'; ...' if len(problems) > 3 else ''}); {NOTHING}",
                           problems=problems)
    return pa.concat_tables(found) if found else shape.empty_table()


def locate(scanned: Scanned, changing: pa.Table, keys: tuple[str, ...],
           where: str) -> tuple[list[TouchedFile], pa.Array]:
    """The table's files holding a key of ``changing``, and per row of ``changing`` the index of
    the file holding its key (-1: none), from the key scan's matches (each key on one row); a
    file delta-rs cannot remove holding one is refused (removable.py)."""
    rows = scanned.rows.select([*keys, FILE_COLUMN])
    probe = changing.select(list(keys)).cast(rows.select(list(keys)).schema)
    probe = probe.append_column("_row", pa.array(range(changing.num_rows), pa.int64()))
    held_rows = rows.join(probe, list(keys), join_type="inner")
    owner = np.full(changing.num_rows, -1, np.int64)
    files = held_rows.column(FILE_COLUMN).to_numpy()
    touched: list[TouchedFile] = []
    indexes, owner[held_rows.column("_row").to_numpy()], counts = np.unique(files, return_inverse=True,
                                                                           return_counts=True)
    for index, count in zip(indexes, counts):
        add = scanned.adds[index]
        if delta_rs_spelling(add["path"]) != add["path"]:
            raise UnremovableFile(f"{where}: {UNREMOVABLE.format(path=add['path'])}; {NOTHING}; {WAY_OUT}",
                                  path=add["path"])
        # The log's path is URL-encoded; delta-rs's actions take it decoded.
        touched.append(TouchedFile(unquote(add["path"]), add["size_bytes"], scanned.values[index], int(count)))
    return touched, pa.array(owner)


def _tasks(table: DeltaTable, changing: pa.Table, keys: tuple[str, ...], touched: list[TouchedFile], owner: pa.Array,
           cluster: ClusterRewrite) -> tuple[list[RewriteTask], list[int]]:
    """The touched files spread over the cluster's slots, or more tasks of about TASK_BYTES each
    (the largest file first, to the task holding the fewest bytes), the inserts spread over them,
    each task's change rows staged (module docstring); and how many upserts each task's are."""
    total = sum(t.size for t in touched)
    groups: list[list[int]] = [[] for _ in range(min(len(touched), max(cluster.slots, -(-total // TASK_BYTES))))]
    sizes = [0] * len(groups)
    for index in sorted(range(len(touched)), key=lambda i: -touched[i].size):
        smallest = sizes.index(min(sizes))
        groups[smallest].append(index)
        sizes[smallest] += touched[index].size
    inserts = pc.indices_nonzero(pc.less(owner, 0))
    count = max(len(groups), -(-len(inserts) // INSERT_ROWS_PER_TASK))
    groups += [[] for _ in range(count - len(groups))]
    fs, root = filesystem(cluster.staging_uri, cluster.storage_options)
    fs.create_dir(root, recursive=True)
    schema = pa.schema(table.schema().to_arrow())
    tasks, upserts = [], []
    for number, files in enumerate(groups):
        mine = pc.is_in(owner, pa.array(files, pa.int64()))
        share = inserts.slice(number * len(inserts) // count, (number + 1) * len(inserts) // count
                              - number * len(inserts) // count)
        rows = pa.concat_tables([changing.filter(mine), changing.take(share)])
        name = f"task-{number}-{uuid.uuid4().hex}.parquet"
        pq.write_table(rows, f"{root}/{name}", filesystem=fs)
        tasks.append(RewriteTask(table.table_uri, schema_text(schema), tuple(table.metadata().partition_columns),
                                 keys, f"{cluster.staging_uri.rstrip('/')}/{name}",
                                 tuple(touched[i] for i in files)))
        upserts.append(pc.sum(pc.equal(rows.column(CHANGE_COLUMN), "upsert")).as_py() or 0)
    return tasks, upserts


def _check(results: list[RewriteResult], tasks: list[RewriteTask], upserts: list[int], changed: int,
           files: list[DataFile], table: DeltaTable, where: str, cluster: ClusterRewrite) -> None:
    """Every task reported, in the tasks' order; each task's rows add up, it dropped exactly the
    changed keys its files hold and added its staged upserts, which are the part's inserts and
    updates; each new file is what the commit may reference (committer.validate_files; the
    offsets of rewritten rows are older than the part's). Else the new files are deleted
    (offered to no commit) and nothing is committed."""
    wrong = len(results) != len(tasks) or sum(upserts) != changed
    for task, result, staged in zip(tasks, results, upserts):
        held = sum(f.keys_held for f in task.files)
        written = sum(f.num_records for f in result.files)
        if result.dropped != held or result.added != staged or written != result.read - result.dropped + result.added:
            wrong = True
    if wrong:
        delete_files(table.table_uri, files, cluster.storage_options)
        per_task = "; ".join(f"task {n}: read {r.read}, dropped {r.dropped} (keys held "
                             f"{sum(f.keys_held for f in t.files)}), added {r.added} (upserts staged {u}), wrote "
                             f"{sum(f.num_records for f in r.files)}" for n, (t, r, u) in enumerate(zip(tasks, results, upserts)))
        raise RewriteMiscount(f"{where}: the rewrite of {sum(len(t.files) for t in tasks)} files in {len(tasks)} tasks "
                              f"({len(results)} reported) does not add up ({per_task}; inserts and updates {changed}); "
                              f"{NOTHING}", tasks=len(tasks), reported=len(results))
    try:
        validate_files(table.table_uri, files, pa.schema(table.schema().to_arrow()),
                       table.metadata().partition_columns, None, cluster.storage_options)
    except InvalidDataFile as exc:
        delete_files(table.table_uri, files, cluster.storage_options)
        raise InvalidDataFile(f"{where}: {exc}; {NOTHING}", **exc.evidence) from exc


__all__ = ["ClusterRewrite", "RemoveMissed", "RewriteMiscount", "Rewritten", "ScanMiscount", "Scanned",
           "UnremovableFile", "commit_rewrite", "locate", "part_of", "rewrite_part", "scan_keys"]
