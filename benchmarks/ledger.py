"""What reading the ledger costs on a long log (a year of hourly commits is 8,760): tables of N
commits, each commit one data file of one record on one of 8 partitions with the batch's positions
and record, committed through the product's committer (commit/committer.py: the txn actions of
every position, the topic's identity and owner, the commit record; delta-rs's checkpoint every 100
commits), against a table of 10. Per table, the median of 7 turns (the tables take turns, so a
drift of this shared machine reaches them alike):

- plan: ``plan_run`` (Kafka's offsets and the table's positions);
- no-op run: ``runner.run`` with nothing new (plan, no Spark), in this process;
- status: ``report.status``;
- page, first view: the oncemore page's read of the pipeline (``pipeline_overview`` with its
  history) by a process that has not read the table yet; later view: the same read again;
- verify: ``oncemore verify`` on Spark local[1] (median of 3: it reads every kept commit by
  design, and every row).

Each is measured as built (every commit file kept, as only a log retention of a year or more
keeps them); with the log as a year of hourly commits leaves it (commit files dated an hour apart,
those older than delta.logRetentionDuration's 30 days cleaned up, as delta-rs does after each
commit); after ``oncemore maintain`` (the files compacted, a checkpoint); and once the removed
files' retention (delta.deletedFileRetentionDuration, 7 days) has passed (set to 0 here). Then
two runs that commit on the largest table: the snapshot loads and commit files each reads.

    scripts/benchmark ledger [--commits 100,1000,8760] [--table-dir DIR]

``--table-dir`` keeps the built tables and their broker's data (DIR/kafka: a broker started for
the benchmark, stopped at its end) to measure again after a change: the build of 8,760 commits
takes many minutes. Not a test: figures, not verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import pyarrow as pa
from deltalake import DeltaTable

from devtools import kafkabroker
from devtools.processes import stop_detached
from oncemore.commit.committer import commit
from oncemore.commit.tables import ensure_tables
from oncemore.config.loading import parse_pipeline
from oncemore.config.values import OffsetBound
from oncemore.core.columns import decoded_schema
from oncemore.core.coordinates import KafkaPartition
from oncemore.kafka import clients
from oncemore.ops.maintain import maintain
from oncemore.ops.reset import reset
from oncemore.plan import ledger
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.plan.planner import plan_run
from oncemore.report import overview
from oncemore.report.status import status
from oncemore.run import runner
from oncemore.write.files import TableWriter

PARTITIONS = 8
REFERENCE = 10  # commits of the table the others are compared with
TURNS = 7


class TableReads:
    """Counts snapshot loads (constructions), incremental updates, txn lookups and commit files read,
    and the wall time spent reading the tables (the outermost of these calls on this thread, and the
    ledger's history reads): what an operation's time is beside Kafka's."""

    DELTA = ("__init__", "update_incremental", "transaction_version", "get_add_actions", "history")
    LEDGER = ("_commits", "kept_versions")

    def __init__(self):
        self.loads = self.updates = self.lookups = self.commits_read = 0
        self.seconds = 0.0
        self._depth = 0
        self._originals: list[tuple[object, str, object]] = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))
        main = threading.main_thread()

        def timed(*args, **kwargs):
            outermost = threading.current_thread() is main and self._depth == 0
            if threading.current_thread() is main:
                self._depth += 1
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if threading.current_thread() is main:
                    self._depth -= 1
                if outermost:
                    self.seconds += time.perf_counter() - begin
                self.loads += name == "__init__"
                self.updates += name == "update_incremental"
                self.lookups += name == "transaction_version"
                self.commits_read += name == "_read_commit"

        setattr(owner, name, timed)

    def __enter__(self):
        for name in self.DELTA:
            self._wrap(DeltaTable, name)
        for name in self.LEDGER:
            self._wrap(Ledger, name)
        self._wrap(ledger, "_read_commit")  # history, read file by file (on a pool's threads)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)

    def __str__(self) -> str:
        return (f"{self.loads} snapshot loads, {self.updates} incremental updates, {self.lookups} txn lookups, "
                f"{self.commits_read} commit files read, {self.seconds:.2f}s reading the tables")


def records_per_partition(commits: int) -> list[int]:
    """Where ``commits`` commits leave each partition: commit n moves partition n % PARTITIONS by one."""
    return [len(range(p, commits, PARTITIONS)) for p in range(PARTITIONS)]


def pipeline_for(bootstrap_servers: str, commits: int, root: Path):
    """The pipeline of the table of ``commits`` commits under ``root``, on its own topic."""
    return parse_pipeline({
        "name": "events", "source": {"bootstrap_servers": bootstrap_servers, "topic": f"events{commits}"},
        "sink": {"table_uri": str(root / f"events{commits}")}, "format": {"type": "raw"},
    }, "<benchmark>", {})


def build(pipeline, commits: int) -> None:
    """``commits`` commits of one record each, as a run's commits record them (commit/part.py)."""
    topic = pipeline.source.topic
    schema = decoded_schema("raw", None, pa.binary(), False)
    ensure_tables(pipeline, schema)
    identity = clients.describe_source(clients.admin_client(pipeline), pipeline).identities[topic]
    ledger_ = Ledger(pipeline.sink.table_uri, pipeline.name)
    keys = [KafkaPartition(topic, p) for p in range(PARTITIONS)]
    log_end = {str(p): n for p, n in enumerate(records_per_partition(commits))}
    started = time.monotonic()
    for n in range(commits):
        partition = n % PARTITIONS
        writer = TableWriter("main", pipeline.sink.table_uri, schema)
        writer.write(pa.table({
            "key": pa.array([None], pa.binary()), "value": pa.array([b"{}"], pa.binary()),
            "_kafka_topic": [topic], "_kafka_partition": pa.array([partition], pa.int32()),
            "_kafka_offset": pa.array([n // PARTITIONS], pa.int64()),
            "_kafka_timestamp": pa.array([None], pa.timestamp("us", tz="UTC")),
        }).cast(schema))
        held = ledger_.positions(keys)
        key = keys[partition]
        start = held[key] or 0
        record = CommitInfo(pipeline=pipeline.name, run_id=f"run-{n // 10}", batch_seq=n % 10, until="latest",
                            ranges={topic: {str(partition): [start, start + 1]}},
                            records={"written": 1, "quarantined": 0, "filtered": 0},
                            topic_ids={topic: identity.topic_id}, cluster_id=identity.cluster_id, bytes_read=2,
                            log_end={topic: log_end}, duration_ms=400)
        commit(ledger_, writer.close(), {key: held[key]}, {key: start + 1}, keys, record)
        if n % 1000 == 999:
            print(f"  {n + 1} commits, {time.monotonic() - started:.0f}s", flush=True)


def no_spark():
    raise AssertionError("a no-op run starts no Spark")


def first_view(pipeline) -> None:
    overview._LEDGERS.clear()  # as a process that has not read the table yet
    overview.pipeline_overview(pipeline, detail=True)


OPERATIONS: dict[str, Callable] = {
    "plan": plan_run,
    "no-op run": lambda p: runner.run(p, spark_factory=no_spark),
    "status": status,
    "page, first view": first_view,
    "page, later view": lambda p: overview.pipeline_overview(p, detail=True),
}


def turns(pipelines: dict[int, object]) -> dict[str, dict[int, tuple[float, float]]]:
    """Seconds per operation and table, whole and reading the tables (TableReads): the median of
    TURNS turns, after one to warm up; in each turn every table takes its turn."""
    seconds = {}
    for name, operation in OPERATIONS.items():
        times: dict[int, list[tuple[float, float]]] = {n: [] for n in pipelines}
        for _ in range(TURNS + 1):
            for n, pipeline in pipelines.items():
                with TableReads() as reads:
                    begin = time.perf_counter()
                    operation(pipeline)
                    times[n].append((time.perf_counter() - begin, reads.seconds))
        seconds[name] = {n: (statistics.median(w for w, _ in t[1:]), statistics.median(r for _, r in t[1:]))
                         for n, t in times.items()}
    return seconds


def verify_seconds(pipelines: dict[int, object], spark) -> dict[int, tuple[float, float]]:
    """Seconds of ``oncemore verify`` per table, whole and reading the tables' logs: the median of 3
    turns, after one to warm Spark up."""
    from oncemore.report.verify import verify

    times: dict[int, list[tuple[float, float]]] = {n: [] for n in pipelines}
    verify(pipelines[REFERENCE], lambda: spark)
    for _ in range(3):
        for n, pipeline in pipelines.items():
            with TableReads() as reads:
                begin = time.perf_counter()
                report = verify(pipeline, lambda: spark)
                times[n].append((time.perf_counter() - begin, reads.seconds))
            if not report.ok:
                raise SystemExit(f"verify of the table of {n} commits failed: {report.describe()}")
    return {n: (statistics.median(w for w, _ in t), statistics.median(r for _, r in t)) for n, t in times.items()}


def show(state: str, pipelines: dict[int, object], seconds: dict[str, dict[int, float]]) -> None:
    sizes = list(pipelines)
    versions = {n: DeltaTable(p.sink.table_uri).version() for n, p in pipelines.items()}
    live = {n: len(DeltaTable(p.sink.table_uri).file_uris()) for n, p in pipelines.items()}
    logged = {n: len([f for f in Path(p.sink.table_uri, "_delta_log").iterdir() if f.suffix == ".json"])
              for n, p in pipelines.items()}
    checkpoints = {n: json.loads(Path(p.sink.table_uri, "_delta_log", "_last_checkpoint").read_text())["version"]
                   if Path(p.sink.table_uri, "_delta_log", "_last_checkpoint").exists() else "none"
                   for n, p in pipelines.items()}
    print(f"\n{state}: versions {', '.join(f'{versions[n]:,}' for n in sizes)}; last checkpoints "
          f"{', '.join(f'{checkpoints[n]:,}' if checkpoints[n] != 'none' else 'none' for n in sizes)}; live files "
          f"{', '.join(f'{live[n]:,}' for n in sizes)}; commit files kept {', '.join(f'{logged[n]:,}' for n in sizes)}")
    print(f"  {'':20}" + "".join(f"{f'{n:,} commits':>15}" for n in sizes)
          + "".join(f"{f'{n:,} / {REFERENCE}':>14}" for n in sizes[1:]))
    for name, by_size in seconds.items():
        for label, part in ((name, 0), ("  reading the tables", 1)):
            print(f"  {label:20}" + "".join(f"{f'{by_size[n][part]:.3f} s':>15}" for n in sizes)
                  + "".join(f"{f'{by_size[n][part] / by_size[REFERENCE][part]:.2f} x':>14}" for n in sizes[1:]))
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", default="100,1000,8760", help="sizes of the tables, comma-separated")
    parser.add_argument("--table-dir", type=Path)
    args = parser.parse_args()
    sizes = [REFERENCE, *sorted({int(n) for n in args.commits.split(",")} - {REFERENCE})]
    built = args.table_dir or Path(tempfile.mkdtemp(prefix="oncemore-ledger-"))
    work = Path(tempfile.mkdtemp(prefix="oncemore-ledger-run-"))
    kafka = built / "kafka"
    port = kafkabroker.free_port()
    kafkabroker.start_detached_kafka(kafka, port=port)
    try:
        broker = kafkabroker.DevBroker(f"127.0.0.1:{port}")
        existing = set(broker.admin().list_topics(timeout=30).topics)
        for n in sizes:
            pipeline = pipeline_for(broker.bootstrap_servers, n, built)
            if pipeline.source.topic not in existing:
                shutil.rmtree(pipeline.sink.table_uri, ignore_errors=True)
                broker.create_topic(pipeline.source.topic, PARTITIONS)
                broker.produce(pipeline.source.topic, [(p, None, b"{}", None)
                                                       for p, count in enumerate(records_per_partition(n))
                                                       for _ in range(count)])
                print(f"building {n:,} commits with a file each in {pipeline.sink.table_uri} ...", flush=True)
                build(pipeline, n)
        # Measured on copies: maintenance, retention and the runs below change them.
        shutil.copytree(built, work, dirs_exist_ok=True, ignore=shutil.ignore_patterns("kafka"))
        pipelines = {n: pipeline_for(broker.bootstrap_servers, n, work) for n in sizes}
        for pipeline in pipelines.values():
            # An earlier benchmark's runs ingested records its tables' copies were dropped with.
            if plan_run(pipeline).batches:
                reset(pipeline, OffsetBound("latest"))

        from oncemore.run.session import spark_session

        spark = spark_session("local[1]")
        states = (
            ("as built, every commit file kept", lambda p: None),
            # An hourly table's log as delta.logRetentionDuration (30 days) keeps it.
            ("the log as hourly commits and 30 days of log retention leave it", hourly),
            # As the maintenance DAG leaves a table: its small files compacted, a checkpoint written.
            ("after maintenance", maintain),
            # The removes compaction wrote expire from the checkpoints after
            # delta.deletedFileRetentionDuration (7 days).
            ("once the removed files' retention has passed", expire),
        )
        for state, change in states:
            for pipeline in pipelines.values():
                change(pipeline)
            seconds = turns(pipelines)
            seconds["verify"] = verify_seconds(pipelines, spark)
            show(state, pipelines, seconds)

        largest = pipelines[sizes[-1]]
        print(f"\nruns that commit on the table of {sizes[-1]:,} commits (one record per partition, Spark local[1]):")
        for run in ("first run", "second run"):
            broker.produce(largest.source.topic, [(p, None, b"{}", None) for p in range(PARTITIONS)])
            with TableReads() as counter:
                began = time.perf_counter()
                report = runner.run(largest, spark_factory=lambda: spark)
                elapsed = time.perf_counter() - began
            parts = sum(len(b.versions) for b in report.batches) or 1
            print(f"  {run}: {report.written} records in {parts} commit(s): {counter}; run {elapsed:.2f}s")
        spark.stop()
    finally:
        stop_detached(kafka)


def hourly(pipeline) -> None:
    """The table's log as it is when its commits came an hour apart: each commit and checkpoint file
    dated an hour after the one before, the newest now, and those older than
    delta.logRetentionDuration (30 days) cleaned up as delta-rs does after its commits."""
    table = DeltaTable(pipeline.sink.table_uri)
    now = time.time()
    for entry in Path(pipeline.sink.table_uri, "_delta_log").iterdir():
        version = entry.name.split(".")[0]
        if version.isdigit():
            when = now - (table.version() - int(version)) * 3600
            os.utime(entry, (when, when))
    table.cleanup_metadata()


def expire(pipeline) -> None:
    """The table once the removes compaction wrote have expired from its checkpoint."""
    table = DeltaTable(pipeline.sink.table_uri)
    table.alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 0 seconds"})
    DeltaTable(pipeline.sink.table_uri).create_checkpoint()


if __name__ == "__main__":
    main()
