"""An upsert part's main commit when its MERGE runs on the cluster (``upsert.merge: cluster``):
copy-on-write of the files holding a changed key, rewritten by the cluster's tasks, committed by
delta-rs in ONE commit of their removes, the new files' adds, the txn actions and the record.

The driver keeps what merge.py decided (the change rows: upserts whole, deletes by key, and
their counts) and only locates the table files that hold their keys, reading their key columns
file by file; each changing key it finds there is an update or a delete, each it does not
is an insert, and these must be the classification's counts before anything is written. The part
of the change rows each task needs is staged as Parquet in the part's staging area, so no change
row travels through Spark. Each task (write/rewrite.py) rewrites its files without the changed
keys' rows and adds the upserts; each task's rows must add up (rows read - rows dropped + rows
added = rows written, the rows dropped are exactly the keys located in its files, the rows added
its staged upserts) and the new files be whole, or nothing is committed (all this runs before the
part's tombstones commit) and the new files are deleted. A touched file whose log path another
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
from oncemore.write.files import DataFile, partition_value_text
from oncemore.write.rewrite import RewriteResult, RewriteTask, TouchedFile, key_batches

log = logging.getLogger("oncemore")

TASK_BYTES = 1 << 30  # touched files' bytes per task at most, beyond one per slot: its wall time, not its memory (it streams)
INSERT_ROWS_PER_TASK = 1_000_000  # inserts per task when no file is touched


class RewriteMiscount(OncemoreError):
    """The cluster's rewrite of an upsert part does not add up: the MERGE commits nothing."""


class RemoveMissed(OncemoreError):
    """A cluster MERGE's commit left a file it removed live in the table: a key is on two rows."""


NOTHING = "nothing was committed to the table or its tombstones table"  # a refusal comes before both commits
UNREMOVABLE = f"file {{path}} holds a changed key, and {SPELLED}: the MERGE would leave it live beside its rewrite"


@dataclass(frozen=True)
class ClusterRewrite:
    """How the run rewrites on its cluster: ``run`` executes the tasks (run/rewritejob.py) and
    returns one result per task, in the tasks' order; ``staging_uri``: where the part's tasks'
    change rows are staged (in the part's staging area, removed with it)."""

    run: Callable[[list[RewriteTask]], list[RewriteResult]]
    staging_uri: str
    storage_options: Mapping[str, str] | None = None
    slots: int = 1  # tasks the cluster runs at once: the touched files are spread over at least as many


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
                 counts: Mapping[str, int], record: CommitInfo, pipeline: str) -> Rewritten:
    """The part's ``changing`` rows applied to ``table`` (the snapshot merge.py classified them
    on) by copy-on-write on the cluster, checked, before any commit of the part (module
    docstring); none of it is committed yet."""
    if not changing.num_rows:  # no event changes a row: the positions alone
        return Rewritten([], [], {})
    where = f"{part_of(pipeline, record)}: {table.table_uri} version {table.version()}"
    began = time.perf_counter()
    touched, owner = locate(table, changing, keys, where, cluster.storage_options)
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


def locate(table: DeltaTable, changing: pa.Table, keys: tuple[str, ...], where: str,
           storage_options: Mapping[str, str] | None = None) -> tuple[list[TouchedFile], pa.Array]:
    """The table's files holding a key of ``changing``, and per row of ``changing`` the index of
    the file holding its key (-1: none); a key on two rows of the table is refused. Each file is
    read as its rewrite reads it (write/rewrite.py), its key columns only."""
    adds = pa.table(table.get_add_actions(flatten=False)).to_pylist()
    partition_columns = list(table.metadata().partition_columns)
    schema = pa.schema(table.schema().to_arrow())
    probe = changing.select(list(keys)).cast(pa.schema([schema.field(k) for k in keys]))
    probe = probe.append_column("_row", pa.array(range(changing.num_rows), pa.int64()))
    fs, root = filesystem(table.table_uri, storage_options)
    owner = np.full(changing.num_rows, -1, np.int64)
    touched: list[TouchedFile] = []
    for add in adds:
        values = {c: partition_value_text((add.get("partition") or {}).get(c)) for c in partition_columns}
        path = unquote(add["path"])  # the log's is URL-encoded; delta-rs's actions take it decoded
        # One join per file: a join hashes ``probe`` (the part's change rows) each time.
        stored = list(key_batches(fs, f"{root}/{path}", keys, values, schema))
        found = pa.concat_tables(stored).join(probe, list(keys), join_type="inner").column("_row") if stored else None
        if found is None or not len(found):
            continue
        rows_found = found.to_numpy()
        unique, times = np.unique(rows_found, return_counts=True)
        twice = [*rows_found[owner[rows_found] != -1].tolist(), *unique[times > 1].tolist()]
        if twice:
            raise RewriteMiscount(f"{where}: key {changing.select(list(keys)).slice(twice[0], 1).to_pylist()[0]} is "
                                  f"on two rows of the table; {NOTHING}", row=twice[0])
        if delta_rs_spelling(add["path"]) != add["path"]:
            raise UnremovableFile(f"{where}: {UNREMOVABLE.format(path=add['path'])}; {NOTHING}; {WAY_OUT}",
                                  path=add["path"])
        owner[rows_found] = len(touched)
        touched.append(TouchedFile(path, add["size_bytes"], values, len(rows_found)))
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


__all__ = ["ClusterRewrite", "RemoveMissed", "RewriteMiscount", "Rewritten", "UnremovableFile", "commit_rewrite",
           "locate", "part_of", "rewrite_part"]
