"""Upserts at scale (issue text: "for 1 M change events over a 10 M-row table on these 2 cores:
time, the driver's peak memory, and files rewritten"), on the local Apache Kafka broker
(kafkabroker.start_kafka), Spark ``local[2]``, one run of each case:

- uniform keys: Debezium change events (devtools/changefeed.py's envelope, sequence_by
  ``source.lsn`` as in include/pipelines/examples/debezium_accounts.yaml) spread over every id of
  the table: 80 % updates, 10 % creates of new ids, 10 % deletes (each followed by its tombstone,
  as Debezium does), a delete's id re-created when drawn again; the MERGE touches every file;
- hot keys: as many events, updates and deletes of the first 1 % of the ids only (no new ids),
  so the MERGE's file pruning (delta-rs's early filter, ``streamed_exec=False``: the source's
  key range) can skip the files holding none of them. It runs first, in the same warm session:
  Spark's JVM and Python workers are reused and keep what they grew to, so the uniform case's
  peaks are its own.

The table is built without Kafka: a first run of one event per partition creates it (and its
quarantine and tombstones tables) and warms the session, then the rows ids 1..N are appended with delta-rs in the table's own schema,
in files of delta-rs's size (``--file-mib``: ~100 MiB, the size its MERGEs write), with
``_kafka_*`` coordinates of a topic no pipeline reads and sequences below every event's. The hot
case's table holds the same files (hard links, one add commit).

Per case: the run's wall time and where it went (the Spark job reading, decoding and staging the
change rows; the commit: oncemore's reduction and classification, the tombstones MERGE, the main
MERGE as delta-rs times it), the peak RSS of every process that does the work, sampled (the run's
Python process, which commits the part and so runs the local MERGE; Spark's JVM; Spark's Python
workers), the files the
MERGE removed and added (its Delta log), the events' counts from the commit record, and the rows
after, checked: the count expected, no id twice, every id an event touched as the last event left it.

    scripts/benchmark upsert [--rows 10000000] [--events 1000000] [--partitions 2] [--file-mib 100]
                             [--no-hot] [--no-sequence]

``--cluster`` (issue 37 §4: 10 M change events over a 100 M-row table on two workers, the
defaults then): on a Spark standalone cluster of two one-core workers
(devtools/sparkcluster.py), the uniform case twice on two copies of the table (hard links) with
the same events: ``upsert.merge: local`` (delta-rs's MERGE in the run's process) and
``upsert.merge: cluster`` (the touched files rewritten by the executors' tasks, committed by the
run's process, commit/copyonwrite.py). Beside the figures above, each executor's JVM and Python
workers' peaks (backfill.py's MemorySamples).

Not a test: figures, not verdicts. Keep the machine otherwise idle; at the defaults its tables
and broker log take ~2 GB under /tmp, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from benchmarks.backfill import MemorySamples
from devtools import kafkabroker
from devtools.changefeed import NAMES, SOURCE
from devtools.sparkcluster import start_spark_cluster
from oncemore.config.loading import parse_pipeline
from oncemore.plan.commitinfo import METADATA_KEY
from oncemore.run import runner
from oncemore.run.session import spark_session

MIB = 2**20
ROW = "id BIGINT, name STRING, balance BIGINT"
SEED_TOPIC = "oncemore-benchmark-seed"  # the appended rows' coordinates: no pipeline reads it
LSN_BASE = 10**10  # the events' sequences start here; the appended rows' are their offsets, below
CREATES, DELETES = 0.10, 0.10  # shares of the events; the rest are updates
HOT_SHARE = 0.01  # the hot case's ids: the first 1 %


def balance_of(ids):
    """The balance the appended rows start with (a numpy array or an int): the events' before images agree."""
    return (ids * 7919) % 10_000


def encoded(document) -> bytes | None:
    return None if document is None else json.dumps(document, separators=(",", ":")).encode()


# ---------------------------------------------------------------- in child processes (spawn)


def write_rows(table_uri: str, rows: int, file_mib: int, copy_uri: str | None) -> tuple[int, int, float]:
    """Appends ids 1..``rows`` to the table with delta-rs (one commit), in its schema; the same
    files hard-linked into ``copy_uri``'s table (one add commit). Returns (files, bytes, seconds)."""
    import numpy as np
    from deltalake import DeltaTable, write_deltalake
    from deltalake.transaction import AddAction

    started = time.perf_counter()
    table = DeltaTable(table_uri)
    schema = pa.schema(table.schema().to_arrow())
    chunk = 1_000_000

    def constant(value, count: int, kind: pa.DataType) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(count, np.int32)), pa.array([value])).cast(kind)

    def batches():
        for start in range(1, rows + 1, chunk):
            ids = np.arange(start, min(start + chunk, rows + 1), dtype=np.int64)
            offsets = ids - 1
            columns = {
                "id": pa.array(ids),
                "name": pa.DictionaryArray.from_arrays(pa.array((ids % len(NAMES)).astype(np.int32)),
                                                       pa.array(NAMES)),
                "balance": pa.array(balance_of(ids)),
                "_sequence": pa.array(offsets),
                "_kafka_topic": constant(SEED_TOPIC, len(ids), pa.string()),
                "_kafka_partition": pa.array(np.zeros(len(ids), np.int32)),
                "_kafka_offset": pa.array(offsets),
                "_kafka_timestamp": pa.array(1_793_491_200_000_000 + offsets * 1000, pa.int64()),
            }
            yield pa.RecordBatch.from_arrays([columns[f.name].cast(f.type) for f in schema], schema=schema)

    before = table.version()
    write_deltalake(table_uri, pa.RecordBatchReader.from_batches(schema, batches()), mode="append",
                    target_file_size=file_mib * MIB)
    adds = [a["add"] for v in range(before + 1, DeltaTable(table_uri).version() + 1)
            for a in map(json.loads, Path(table_uri, "_delta_log", f"{v:020d}.json").read_text().splitlines())
            if "add" in a]
    if copy_uri is not None:
        copy = DeltaTable(copy_uri)
        for add in adds:
            os.link(Path(table_uri, add["path"]), Path(copy_uri, add["path"]))
        copy.create_write_transaction(
            [AddAction(a["path"], a["size"], a["partitionValues"], a["modificationTime"], True, a["stats"]) for a in adds],
            mode="append", schema=copy.schema())
    return len(adds), sum(a["size"] for a in adds), time.perf_counter() - started


@dataclass
class Events:
    """What a case's events are, and what the table must hold after them."""

    ops: dict[str, int]  # c (new ids and re-creates), u, d, tombstone
    recreates: int
    rows_after: int
    touched_path: str  # Parquet: id, name, balance, alive (the last event of every id touched)
    records: int
    bytes: int
    seconds: float


def produce_events(bootstrap: str, topic: str, partitions: int, rows: int, events: int, key_range: int,
                   new_ids: bool, seed: int, first: int, touched_path: str) -> Events:
    """``events`` Debezium change events (ops c, u, d; a tombstone after each d) of ids 1..``key_range``
    (and, with ``new_ids``, creates of ids past ``rows``), keys spread uniformly, in LSN order, each
    to partition crc32(key) mod ``partitions`` (as Debezium's Kafka Connect producer does). The table
holds ``first`` rows of ids <= 0 besides (first_events)."""
    started = time.perf_counter()
    rng = random.Random(seed)
    state: dict[int, dict | None] = {}  # the rows of the ids touched so far; None: deleted
    ops = dict.fromkeys(("c", "u", "d", "tombstone"), 0)
    recreates, next_id, lsn, tx_id, size = 0, rows + 1, LSN_BASE, 0, 0

    def current(id_: int) -> dict | None:
        if id_ in state:
            return state[id_]
        return {"id": id_, "name": NAMES[id_ % len(NAMES)], "balance": balance_of(id_)} if id_ <= rows else None

    def records():
        nonlocal recreates, next_id, lsn, tx_id, size
        for _ in range(events):
            draw = rng.random()
            if new_ids and draw < CREATES:
                id_, next_id = next_id, next_id + 1
            else:
                id_ = rng.randint(1, key_range)
            before = current(id_)
            if before is None:
                op, after = "c", {"id": id_, "name": rng.choice(NAMES), "balance": rng.randint(0, 10_000)}
                recreates += id_ <= rows
            elif new_ids and draw < CREATES + DELETES or not new_ids and draw < DELETES:
                op, after = "d", None
            else:
                op, after = "u", {**before, "balance": rng.randint(0, 10_000)}
            state[id_] = after
            ops[op] += 1
            lsn, tx_id = lsn + rng.randint(8, 96), tx_id + 1
            ts_ms = 1_790_000_000_000 + (lsn - LSN_BASE) // 8
            source = {**SOURCE, "lsn": lsn, "txId": tx_id, "ts_ms": ts_ms, "snapshot": "false"}
            key = encoded({"id": id_})
            partition = zlib.crc32(key) % partitions
            value = encoded({"before": before, "after": after, "op": op, "ts_ms": ts_ms + 5, "source": source,
                             "transaction": None})
            size += len(key) + len(value)
            yield partition, key, value, None
            if op == "d":
                ops["tombstone"] += 1
                size += len(key)
                yield partition, key, None, None

    delivered = kafkabroker.DevBroker(bootstrap).produce(topic, records())
    ids = sorted(state)
    rows_after = rows + first + sum((state[i] is not None) - (i <= rows) for i in ids)
    kept = [state[i] or {} for i in ids]
    pq.write_table(pa.table({"id": pa.array(ids, pa.int64()), "name": pa.array([r.get("name") for r in kept], pa.string()),
                             "balance": pa.array([r.get("balance") for r in kept], pa.int64()),
                             "alive": pa.array([state[i] is not None for i in ids])}), touched_path)
    return Events(ops, recreates, rows_after, touched_path, len(delivered), size, time.perf_counter() - started)


# ---------------------------------------------------------------- in the run's process


class Peaks(threading.Thread):
    """Samples (every 0.1 s) the RSS of the run's Python process (which commits, the MERGE
    included), Spark's JVM and its Python descendants (the tasks' workers) until the run ends; the
    descendants also summed (proportional set sizes: a forked worker shares its parent's pages)."""

    def __init__(self, jvm_pid: int):
        super().__init__(daemon=True)
        self.jvm_pid, self.running = jvm_pid, True
        self.driver = self.jvm = self.workers_reading = self.worker_reading = 0

    def run(self):
        me = psutil.Process()
        try:
            jvm = psutil.Process(self.jvm_pid)
        except psutil.Error:
            jvm = None
        while self.running:
            self.driver = max(self.driver, me.memory_info().rss)
            proportional, each = 0, []
            if jvm is not None:
                try:
                    self.jvm = max(self.jvm, jvm.memory_info().rss)
                    children = jvm.children(recursive=True)
                except psutil.Error:
                    children = []
                for child in children:
                    try:
                        each.append(child.memory_info().rss)
                        proportional += child.memory_full_info().pss
                    except psutil.Error:
                        continue
            self.workers_reading = max(self.workers_reading, proportional)
            self.worker_reading = max([self.worker_reading] + each)
            time.sleep(0.1)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.join()


@dataclass
class Commit:
    version: int
    operation: str
    adds: int = 0
    removes: int = 0
    add_bytes: int = 0
    remove_bytes: int = 0
    metrics: dict = field(default_factory=dict)
    predicate: str = ""  # a MERGE's: the files it may touch (delta-rs's early filter)
    record: dict = field(default_factory=dict)


def commits_after(table_uri: str, version: int) -> list[Commit]:
    """The commits of the table after ``version``, from its Delta log's JSON."""
    found = []
    for path in sorted(Path(table_uri, "_delta_log").glob("*.json")):
        number = int(path.stem)
        if number <= version:
            continue
        commit = Commit(number, "?")
        for action in map(json.loads, path.read_text().splitlines()):
            if "add" in action:
                commit.adds, commit.add_bytes = commit.adds + 1, commit.add_bytes + action["add"]["size"]
            elif "remove" in action:
                commit.removes += 1
                commit.remove_bytes += action["remove"].get("size") or 0
            elif "commitInfo" in action:
                info = action["commitInfo"]
                commit.operation = info.get("operation", "?")
                commit.metrics = info.get("operationMetrics") or {}
                commit.predicate = (info.get("operationParameters") or {}).get("predicate") or ""
                commit.record = json.loads(info[METADATA_KEY]) if METADATA_KEY in info else {}
        found.append(commit)
    return found


def latest_version(table_uri: str) -> int:
    return max(int(p.stem) for p in Path(table_uri, "_delta_log").glob("*.json"))


def table_files(table_uri: str) -> tuple[int, int, int]:
    """(files, bytes, rows) of the table's current version, from its log (no data read)."""
    from deltalake import DeltaTable

    adds = DeltaTable(table_uri).get_add_actions(flatten=True)
    adds = pa.table(adds) if not isinstance(adds, pa.Table) else adds
    return adds.num_rows, pc.sum(adds.column("size_bytes")).as_py() or 0, pc.sum(adds.column("num_records")).as_py() or 0


def pipeline_for(broker, work: str, case: str, events: int, sequenced: bool, merge: str = "local"):
    upsert = {"keys": ["id"], "envelope": "debezium", "merge": merge,
              **({"sequence_by": "source.lsn"} if sequenced else {})}
    return parse_pipeline({
        "name": f"accounts_{case}",
        "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": f"accounts_{case}"},
        "sink": {"table_uri": f"{work}/{case}/accounts", "quarantine_uri": f"{work}/{case}/accounts_quarantine"},
        "key": {"type": "json", "schema": "id BIGINT"},
        "format": {"type": "json", "schema": ROW},
        "upsert": upsert,
        # One commit for all of them: a task per partition, the byte budgets at their defaults.
        "limits": {"max_records_per_commit": 2 * events + 1, "max_records_per_partition": 2 * events + 1},
    }, "benchmark", {})


def first_events(broker, topic: str, partitions: int) -> int:
    """A create of an id <= 0 in each partition: the first run, of these records, creates the
    tables and has a task (a Python worker) per partition, as the measured runs do. Their count."""
    ids: dict[int, int] = {}
    id_ = 0
    while len(ids) < partitions:
        ids.setdefault(zlib.crc32(encoded({"id": id_})) % partitions, id_)
        id_ -= 1
    records = []
    for lsn, (partition, id_) in enumerate(sorted(ids.items()), LSN_BASE - partitions):
        source = {**SOURCE, "lsn": lsn, "txId": 0, "ts_ms": 1_790_000_000_000, "snapshot": "false"}
        records.append((partition, encoded({"id": id_}), encoded({
            "before": None, "after": {"id": id_, "name": NAMES[0], "balance": 0}, "op": "c",
            "ts_ms": 1_790_000_000_005, "source": source, "transaction": None}), None))
    broker.produce(topic, records)
    return len(records)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / MIB:,.0f} MiB"


def seconds(profile: dict, phase: str) -> float:
    return profile.get(phase, 0) / 1000


class ClusterMergeLines(logging.Handler):
    """Prints the cluster MERGE's own account of its phases (commit/copyonwrite.py logs it at INFO)."""

    def __init__(self):
        super().__init__(logging.INFO)
        logging.getLogger("oncemore").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        if "the cluster MERGE" in record.getMessage():
            print(f"    {record.getMessage()}", flush=True)


def measure(case: str, pipeline, spark, events: Events, workers: list[int] | None = None) -> dict:
    """One run of the case's events, its figures printed; the summary's returned."""
    table_uri = pipeline.sink.table_uri
    files_before, bytes_before, _ = table_files(table_uri)
    main_before = latest_version(table_uri)
    tombstones_uri = pipeline.sink.tombstones_uri if pipeline.upsert.sequence_by else None
    tombstones_before = latest_version(tombstones_uri) if tombstones_uri else None
    driver_hwm_before = _vm_hwm(os.getpid())
    jvm_pid = spark.sparkContext._gateway.proc.pid
    with Peaks(jvm_pid) as peaks, MemorySamples(jvm_pid, workers or []) as executors:
        started = time.perf_counter()
        report = runner.run(pipeline, spark_factory=lambda: spark)
        wall = time.perf_counter() - started
    driver_hwm = _vm_hwm(os.getpid())

    main = [c for c in commits_after(table_uri, main_before) if c.record.get("run_id") == report.run_id]
    tombs = ([c for c in commits_after(tombstones_uri, tombstones_before) if c.record.get("run_id") == report.run_id]
             if tombstones_uri else [])
    if not main:
        sys.exit(f"{case}: the run made no commit of the table: {report.summary()}")
    counts: dict[str, int] = {}
    for c in main:
        for name, value in c.record.get("records", {}).items():
            counts[name] = counts.get(name, 0) + value
    profile = report.profile
    # delta-rs's MERGE, or (upsert.merge: cluster) the copy-on-write's commit of removes and adds.
    merges = [c for c in main if c.operation == "MERGE" or c.removes]
    metric = lambda name, commits=merges: sum(int(c.metrics.get(name, 0)) for c in commits)  # noqa: E731
    merge_s = metric("execution_time_ms") / 1000
    tomb_s = metric("execution_time_ms", tombs) / 1000
    print(f"  run {wall:.1f}s, {len(main)} commit(s) of the table (versions {', '.join(str(c.version) for c in main)})"
          + (f", {len(tombs)} of its tombstones table" if tombstones_uri else ""), flush=True)
    print(f"    Spark job {seconds(profile, 'spark_job'):.1f}s (submission to the part's commit: read + decode + the "
          f"change rows staged; task time read {seconds(profile, 'read'):.1f}s, decode "
          f"{seconds(profile, 'decode'):.1f}s, write {seconds(profile, 'write'):.1f}s), validate "
          f"{seconds(profile, 'validate'):.1f}s", flush=True)
    cluster_merge = pipeline.upsert.merge == "cluster"
    if cluster_merge:
        print(f"    commit {seconds(profile, 'commit'):.1f}s in the run's process: the tombstones MERGE {tomb_s:.1f}s; the "
              "rest: change rows read back, reduced per key, the table's keys scanned on the executors, classified, the "
              "touched files located, the rewrite job "
              "on the executors, the one commit of removes, adds and positions", flush=True)
    else:
        print(f"    commit {seconds(profile, 'commit'):.1f}s: the main MERGE {merge_s:.1f}s (delta-rs: scan "
              f"{metric('scan_time_ms') / 1000:.1f}s, rewrite {metric('rewrite_time_ms') / 1000:.1f}s), "
              + (f"the tombstones MERGE {tomb_s:.1f}s, " if tombstones_uri else "")
              + f"the rest {seconds(profile, 'commit') - merge_s - tomb_s:.1f}s (change rows read back, reduced per "
              "key, classified against the table's rows of their ids, positions checked)", flush=True)
    print(f"    plan {seconds(profile, 'plan'):.2f}s, prepare {seconds(profile, 'prepare'):.2f}s; the rest of the wall "
          f"time {wall - sum(seconds(profile, p) for p in ('plan', 'prepare', 'spark_job', 'validate', 'commit')):.1f}s",
          flush=True)
    applied = {k: counts.get(k, 0) for k in ("inserted", "updated", "deleted", "noop_deletes", "stale", "superseded",
                                             "tombstones", "quarantined", "filtered")}
    print(f"  records: {', '.join(f'{v:,} {k}' for k, v in applied.items())} (commit record)" + ("" if cluster_merge else
          f"; delta-rs: {metric('num_source_rows'):,} source rows, {metric('num_target_rows_inserted'):,} inserted, "
          f"{metric('num_target_rows_updated'):,} updated, {metric('num_target_rows_deleted'):,} deleted, "
          f"{metric('num_target_rows_copied'):,} copied unchanged"), flush=True)
    removed, added = sum(c.removes for c in merges), sum(c.adds for c in merges)
    # delta-rs 1.6.6's num_target_files_scanned/skipped_during_scan say 0 scanned while files are
    # rewritten: the log's remove and add actions are the figures.
    print(f"  files: the MERGE removed {removed} of the table's {files_before} ({gib(sum(c.remove_bytes for c in merges))} "
          f"of {gib(bytes_before)}) and added {added} ({gib(sum(c.add_bytes for c in merges))})" + (
              " (the copy-on-write's commit)" if cluster_merge else
              f" (delta-rs: {metric('num_target_files_removed')} removed, {metric('num_target_files_added')} added); "
              f"its early filter (the files it may touch): {' | '.join(c.predicate for c in merges) or 'none'}")
          + (f"; tombstones table: {sum(c.adds for c in tombs)} file(s) added, {sum(c.removes for c in tombs)} removed"
             if tombstones_uri else ""), flush=True)
    print(f"  peak RSS: the run's Python process {gib(peaks.driver)} (its high-water mark {gib(driver_hwm)}, "
          f"{gib(driver_hwm_before)} before the run), Spark's JVM {gib(peaks.jvm)}; Spark's Python processes "
          f"{gib(peaks.workers_reading)} in all (proportional), {gib(peaks.worker_reading)} the largest", flush=True)
    for (worker, executor, pid) in sorted(executors.executors):
        jvm, python_sum, python_max = executors.executor_peaks((worker, executor, pid))
        print(f"  executor {executor} on worker {worker} (pid {pid}): JVM {gib(jvm)}, its Python workers {gib(python_sum)} "
              f"in all, {gib(python_max)} the largest", flush=True)
    if pipeline.upsert.merge == "cluster":
        print("  the commit (the copy-on-write's classification, location and commit) ran in the run's process; the "
              "key scan and the rewrite in the executors' Python workers", flush=True)
    else:
        print("  the commit (the MERGE) ran in the run's process", flush=True)
    verify(table_uri, events)
    executor_peak = max((executors.executor_peaks(k)[0] for k in executors.executors), default=0)
    worker_peak = max((executors.executor_peaks(k)[2] for k in executors.executors), default=0)
    return {"run": f"{wall:.1f}s", "Spark job": f"{seconds(profile, 'spark_job'):.1f}s",
            "commit": f"{seconds(profile, 'commit'):.1f}s", "MERGE": "-" if cluster_merge else f"{merge_s:.1f}s",
            "run's process (commits)": gib(peaks.driver), "JVM": gib(peaks.jvm),
            **({"executor JVM": gib(executor_peak), "executor Python": gib(worker_peak)} if workers else {}),
            "files rewritten": f"{removed} of {files_before} ({gib(sum(c.remove_bytes for c in merges))}), {added} added"}


def _vm_hwm(pid: int) -> int:
    """A process's peak RSS so far (Linux's VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def verify(table_uri: str, events: Events) -> None:
    """The rows after: the count expected, no id twice, every id an event touched as its last event left it."""
    from deltalake import DeltaTable

    started = time.perf_counter()
    files, size, logged = table_files(table_uri)
    dataset = DeltaTable(table_uri).to_pyarrow_dataset()
    ids = dataset.to_table(columns=["id"]).column("id")
    distinct = pc.count_distinct(ids).as_py()
    touched = pq.read_table(events.touched_path)
    found = dataset.to_table(columns=["id", "name", "balance"], filter=ds.field("id").isin(touched.column("id")))
    joined = touched.join(found, "id", join_type="left outer", right_suffix="_table")
    alive = joined.column("alive")
    wrong = pc.sum(pc.if_else(alive, pc.invert(pc.and_(pc.fill_null(pc.equal(joined.column("name"),
                                                                               joined.column("name_table")), False),
                                                       pc.fill_null(pc.equal(joined.column("balance"),
                                                                             joined.column("balance_table")), False))),
                              pc.is_valid(joined.column("name_table")))).as_py() or 0
    ok = len(ids) == events.rows_after == logged and distinct == len(ids) and wrong == 0
    print(f"  after: {len(ids):,} rows (expected {events.rows_after:,}; the log says {logged:,}) in {files} files "
          f"({gib(size)}), {distinct:,} distinct ids, {touched.num_rows:,} ids touched, {wrong:,} of them not as their "
          f"last event left them: {'OK' if ok else 'WRONG'} (checked in {time.perf_counter() - started:.1f}s)",
          flush=True)
    if not ok:
        sys.exit(f"{table_uri}: the table is not what the events make of it")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, help="rows of the table before the events (10 M; 100 M with --cluster)")
    parser.add_argument("--events", type=int, help="change events per case, tombstones apart (1 M; 10 M with --cluster)")
    parser.add_argument("--partitions", type=int, default=2, help="of each topic")
    parser.add_argument("--file-mib", type=int, default=100, help="the appended rows' file size (delta-rs's default)")
    parser.add_argument("--no-hot", action="store_true", help="the uniform case only")
    parser.add_argument("--no-sequence", action="store_true", help="offset order: no sequence_by, no tombstones table")
    parser.add_argument("--cluster", action="store_true", help="upsert.merge local against cluster on two Spark workers")
    parser.add_argument("--worker-memory", default="2g", help="with --cluster, each worker's memory (its executor asks 1g)")
    args = parser.parse_args()
    rows = args.rows or (100_000_000 if args.cluster else 10_000_000)
    events_per_case = args.events or (10_000_000 if args.cluster else 1_000_000)
    logging.basicConfig(level=logging.WARNING)
    for handler in logging.getLogger().handlers:  # oncemore's INFO lines reach ClusterMergeLines alone
        handler.setLevel(logging.WARNING)
    logging.getLogger("oncemore").addHandler(ClusterMergeLines())
    # Hot first: Spark's JVM, its Python workers and this process (which commits) are reused and
    # keep what they grew to, so the uniform case's peaks are its own, not the hot case's. With
    # --cluster, cluster first, as before the local MERGE moved into this process: its figures stay
    # comparable with the ones docs/performance.md gives.
    cases = ["cluster", "local"] if args.cluster else ([] if args.no_hot else ["hot"]) + ["uniform"]
    sequenced = not args.no_sequence
    work = tempfile.mkdtemp(prefix="oncemore-upsert-")
    began = time.perf_counter()
    cluster = None
    try:
        with kafkabroker.running(kafkabroker.start_kafka()) as broker:
            if args.cluster:
                cluster = start_spark_cluster(cores=1, workers=2, memory=args.worker_memory, log_dir=f"{work}/spark")
            spark = spark_session(cluster.master_url if cluster else "local[2]")
            pipelines = {case: pipeline_for(broker, work, case, events_per_case, sequenced,
                                            "cluster" if case == "cluster" else "local") for case in cases}
            for case, pipeline in pipelines.items():
                broker.create_topic(pipeline.source.topic, args.partitions)
                first = first_events(broker, pipeline.source.topic, args.partitions)
                runner.run(pipeline, spark_factory=lambda: spark)  # creates the tables; warms the session
            # The rows and the events in two processes side by side (the figures below are of the
            # runs alone, in this process and the JVM's).
            context = multiprocessing.get_context("spawn")
            with context.Pool(2) as pool:
                written = pool.apply_async(write_rows, (pipelines[cases[-1]].sink.table_uri, rows, args.file_mib,
                                                        pipelines[cases[0]].sink.table_uri if len(cases) > 1 else None))
                produced = {}
                for case, pipeline in pipelines.items():
                    hot = case == "hot"
                    produced[case] = pool.apply_async(produce_events, (
                        broker.bootstrap_servers, pipeline.source.topic, args.partitions, rows, events_per_case,
                        max(1, int(rows * HOT_SHARE)) if hot else rows, not hot, int(hot), first,
                        f"{work}/{case}-touched.parquet"))
                files, size, took = written.get()
                events = {case: result.get() for case, result in produced.items()}
            where = (f"a Spark standalone cluster of 2 workers of 1 core and {args.worker_memory}" if cluster else
                     "Spark local[2]")
            print(f"table: {rows:,} rows appended with delta-rs in {files} file(s) ({gib(size)}, "
                  f"~{size / max(files, 1) / MIB:,.0f} MiB each) in {took:.1f}s; {where}, "
                  f"{os.cpu_count()} cores, {'sequence_by source.lsn' if sequenced else 'offset order'}", flush=True)
            summary = {}
            for case, pipeline in pipelines.items():
                e = events[case]
                ids = (f"ids 1..{max(1, int(rows * HOT_SHARE)):,} (the first {HOT_SHARE:.0%})" if case == "hot"
                       else f"ids 1..{rows:,} and new ones")
                print(f"\n{case if cluster else case + ' keys'}: {events_per_case:,} change events ({e.ops['u']:,} u, "
                      f"{e.ops['c']:,} c of which {e.recreates:,} re-create a deleted id, {e.ops['d']:,} d) + "
                      f"{e.ops['tombstone']:,} tombstones = {e.records:,} records ({gib(e.bytes)}) over {ids}, in "
                      f"{args.partitions} partitions by key (produced in {e.seconds:.1f}s), upsert.merge "
                      f"{pipeline.upsert.merge}", flush=True)
                summary[case] = measure(case, pipeline, spark, e, [w.pid for w in cluster.workers] if cluster else None)
            spark.stop()
        print(f"\n{events_per_case:,} change events over a {rows:,}-row table, {os.cpu_count()} cores (peak RSS: "
              "the commit's Python process, where the MERGE's driver side runs; Spark's JVM; the run's own Python "
              "process" + ("; the largest executor JVM and executor Python worker" if cluster else "") + "):")
        columns = list(summary[cases[-1]])
        widths = {c: max(len(c), *(len(row[c]) for row in summary.values())) for c in columns}
        print("  " + f"{'case':<8}" + "  ".join(f"{c:>{widths[c]}}" for c in columns))
        for case, row in summary.items():
            print("  " + f"{case:<8}" + "  ".join(f"{row[c]:>{widths[c]}}" for c in columns))
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nthe benchmark took {time.perf_counter() - began:.0f}s in all", flush=True)


if __name__ == "__main__":
    main()
