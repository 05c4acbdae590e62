"""What reading the ledger costs on a long log: a table of N oncemore commits with one data file
each (positions of 8 partitions, batch records, as ingestion writes them), then

- planning a run (Kafka offsets + the Delta log; median of 5) against it and against a table of
  10 commits: the issue's bound is 1.5 times; then again once maintenance has compacted it, and
  once the retention periods of its removed files and commit files have passed;
- the snapshot loads a run makes per batch part and the seconds they take (a run of one record
  per partition, Spark local[1]; Spark's own time is not counted), and
- the oncemore page's read of a pipeline (seconds, median of 5).

    scripts/benchmark ledger [--commits 5000] [--table-dir DIR]

``--table-dir`` keeps the built table to measure again after a change (the build takes minutes).
Not a test: figures, not verdicts.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from devtools import kafkabroker
from oncemore.commit.committer import commit
from oncemore.commit.tables import ensure_tables
from oncemore.config.loading import parse_pipeline
from oncemore.core.columns import decoded_schema
from oncemore.core.coordinates import KafkaPartition
from oncemore.ops.maintain import maintain
from oncemore.plan import ledger
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.plan.planner import LATEST, plan_run
from oncemore.report.overview import pipeline_overview
from oncemore.run import runner
from oncemore.write.files import TableWriter

PARTITIONS = 8


class LoadCounter:
    """Counts and times snapshot loads (constructions), incremental updates and commit files read."""

    def __init__(self):
        self.loads = self.updates = self.commits_read = 0
        self.seconds = 0.0
        self._originals = {}

    def __enter__(self):
        for name in ("__init__", "update_incremental", "history"):
            original = getattr(DeltaTable, name)
            self._originals[name] = original

            def timed(table, *args, _original=original, _name=name, **kwargs):
                begin = time.perf_counter()
                try:
                    result = _original(table, *args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - begin
                if _name == "history":
                    self.commits_read += len(result)
                else:
                    self.loads += _name == "__init__"
                    self.updates += _name == "update_incremental"
                return result

            setattr(DeltaTable, name, timed)
        read_commit = self._originals["_read_commit"] = ledger._read_commit  # history, read file by file

        def counted(*args):
            begin = time.perf_counter()
            try:
                return read_commit(*args)
            finally:
                self.seconds += time.perf_counter() - begin
                self.commits_read += 1

        ledger._read_commit = counted
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(ledger if name == "_read_commit" else DeltaTable, name, original)

    def __str__(self) -> str:
        return (f"{self.loads} snapshot loads, {self.updates} incremental updates, {self.commits_read} commit files "
                f"read, {self.seconds:.2f}s in them")


def build(pipeline, commits: int) -> None:
    schema = decoded_schema("raw", None, pa.binary(), False)
    ensure_tables(pipeline, schema)
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name)
    keys = [KafkaPartition("events", p) for p in range(PARTITIONS)]
    started = time.monotonic()
    for n in range(commits):
        partition = n % PARTITIONS
        writer = TableWriter("main", pipeline.sink.table_uri, schema)
        writer.write(pa.table({
            "key": pa.array([None], pa.binary()), "value": pa.array([b"{}"], pa.binary()),
            "_kafka_topic": ["events"], "_kafka_partition": pa.array([partition], pa.int32()),
            "_kafka_offset": pa.array([n // PARTITIONS], pa.int64()),
            "_kafka_timestamp": pa.array([None], pa.timestamp("us", tz="UTC")),
        }).cast(schema))
        held = ledger.positions(keys)
        key = keys[partition]
        start = held[key] or 0
        record = CommitInfo(pipeline="events", run_id=f"run-{n // 10}", batch_seq=n % 10,
                              ranges={"events": {str(partition): [start, start + 1]}},
                              records={"written": 1, "quarantined": 0, "filtered": 0},
                              log_end={"events": {str(partition): commits}}, duration_ms=400)
        commit(ledger, writer.close(), {key: held[key]}, {key: start + 1}, keys, record)
        if n % 500 == 499:
            print(f"  {n + 1} commits, {time.monotonic() - started:.0f}s", flush=True)


def planning_seconds(pipeline) -> float:
    """Planning a run (Kafka offsets + the Delta log): the median of 5, after one to warm up."""
    times = []
    for _ in range(6):
        begin = time.perf_counter()
        plan_run(pipeline, LATEST)
        times.append(time.perf_counter() - begin)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--commits", type=int, default=5_000)
    parser.add_argument("--table-dir", type=Path)
    args = parser.parse_args()
    built = args.table_dir or Path(tempfile.mkdtemp(prefix="oncemore-ledger-"))
    work = Path(tempfile.mkdtemp(prefix="oncemore-ledger-run-"))
    per_partition = -(-args.commits // PARTITIONS)
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        broker.create_topic("events", PARTITIONS)
        broker.produce("events", [(p, None, b"{}", None) for p in range(PARTITIONS) for _ in range(per_partition + 1)])
        pipeline = parse_pipeline({
            "name": "events", "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": "events"},
            "sink": {"table_uri": str(work / "events")}, "format": {"type": "raw"},
        }, "<benchmark>", {})
        if not (built / "events" / "_delta_log").exists():
            print(f"building {args.commits} commits with a file each in {built} ...", flush=True)
            build(pipeline.model_copy(update={"sink": pipeline.sink.model_copy(update={
                "table_uri": str(built / "events"), "quarantine_uri": str(built / "events_quarantine")})}), args.commits)
        # The run below commits: measure on a copy, so the built table serves again.
        shutil.copytree(built, work, dirs_exist_ok=True)
        table = DeltaTable(pipeline.sink.table_uri)
        print(f"table: version {table.version()}, {len(table.file_uris())} files, "
              f"{len(list((work / 'events' / '_delta_log').glob('*.checkpoint.parquet')))} checkpoints")
        short = pipeline.model_copy(update={"sink": pipeline.sink.model_copy(update={
            "table_uri": str(work / "short"), "quarantine_uri": str(work / "short_quarantine")})})
        build(short, 10)
        few_s = planning_seconds(short)
        many_s = planning_seconds(pipeline)
        print(f"planning: {few_s:.3f}s on 10 commits, {many_s:.3f}s on {table.version()} commits "
              f"({len(table.file_uris())} live files) = {many_s / few_s:.2f} x (bound 1.5 x)")
        # As the maintenance DAG leaves the table: its small files compacted, a checkpoint written.
        maintain(pipeline)
        table = DeltaTable(pipeline.sink.table_uri)
        kept_s = planning_seconds(pipeline)
        print(f"planning after maintenance: {kept_s:.3f}s on {table.version()} commits "
              f"({len(table.file_uris())} live files) = {kept_s / few_s:.2f} x (bound 1.5 x)")
        # As retention leaves a long-lived table: the removes compaction wrote expire from its
        # checkpoints (delta.deletedFileRetentionDuration, 7 days by default) and commit files from
        # its log (delta.logRetentionDuration, 30 days: ~720 commits of an hourly pipeline). This
        # table was built in minutes, so both are set to 0 here to stand for the time passed.
        table.alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 0 seconds",
                                          "delta.logRetentionDuration": "interval 0 seconds"})
        table = DeltaTable(pipeline.sink.table_uri)
        table.create_checkpoint()
        table.cleanup_metadata()
        retained_s = planning_seconds(pipeline)
        log_files = len(list((work / "events" / "_delta_log").iterdir()))
        print(f"planning once retention has passed: {retained_s:.3f}s on {table.version()} commits ({log_files} "
              f"files left in _delta_log) = {retained_s / few_s:.2f} x (bound 1.5 x)")

        from oncemore.run.session import spark_session

        spark = spark_session("local[1]")
        # Positions now match the test topic's log: one record per partition is left to ingest. The
        # first run of a table written before identity txns reads its whole log once to find them.
        for run in ("first run", "second run"):
            with LoadCounter() as counter:
                began = time.perf_counter()
                report = runner.run(pipeline, spark_factory=lambda: spark)
                elapsed = time.perf_counter() - began
            parts = sum(len(b.versions) for b in report.batches) or 1
            print(f"{run}: {report.written} records in {parts} commit(s): {counter}; run {elapsed:.2f}s")
            broker.produce("events", [(p, None, b"{}", None) for p in range(PARTITIONS)])
        times = []
        for _ in range(5):
            with LoadCounter() as counter:
                begin = time.perf_counter()
                pipeline_overview(pipeline, detail=True)
                times.append(time.perf_counter() - begin)
        print(f"pipeline page (overview with history): first view {times[0]:.3f}s, later views median "
              f"{statistics.median(times[1:]):.3f}s; a later view: {counter}")
        spark.stop()


if __name__ == "__main__":
    main()
