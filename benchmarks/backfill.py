"""A backfill across Spark workers (issue 37, section 3): ONE run of ``--records`` (default 50 M)
over a topic of ``--partitions`` (1,000) on the local Apache Kafka broker (kafkabroker.start_kafka),
on a Spark standalone cluster of two workers with one core each (devtools.sparkcluster: each worker
runs its own executor JVM and Python workers), with the pipeline's default limits, so the run makes
several batches of at most 1 M records (1,000 ranges of 1,000 records each at 1,000 partitions).

    scripts/benchmark backfill [--records 50000000] [--partitions 1000] [--worker-memory 2g]

Prints the records, batches, wall time and rate of the run; where each batch's time went (its
commit records' profiles: the Spark job's wall clock, the tasks' read, decode and write summed
over both executors; read per range, where the cost of opening each range shows); per executor,
its tasks and task time (Spark's REST API) and its peak RSS, sampled every 0.2 s (its
CoarseGrainedExecutorBackend JVM, and the sum and the largest of its Python workers); the driver's
peak RSS (this process and its JVM) during the first batch, the last batch and the whole run, to
show whether it grows with the records; the no-op rerun's wall time (warm, in this process). Then
counts the table's (_kafka_partition, _kafka_offset) pairs: per partition every offset of [0, log
end) exactly once, and the quarantine table empty, else it exits non-zero naming the first
partition that is not. Child processes produce the records, so their memory stays out of the
driver's figures. Figures, not verdicts: it fails only when the run fails or the table is not exact.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from confluent_kafka import TopicPartition
from confluent_kafka.admin import OffsetSpec
from deltalake import DeltaTable

from devtools import kafkabroker
from devtools.sparkcluster import start_spark_cluster
from oncemore.config.model import Limits
from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN
from oncemore.plan.ledger import Ledger
from oncemore.run import runner
from oncemore.run.session import spark_session

sys.path.insert(0, str(Path(__file__).parent))
from throughput import make_records, pipeline_for  # noqa: E402  (the same records and pipeline)

MIB = 2**20
TOPIC = "backfill"
PRODUCERS = 2  # processes, one per core
PRODUCE_CHUNK = 1_000_000  # records per DevBroker.produce call, which keeps every delivery report


def produce(bootstrap_servers: str, records: int, partitions: int) -> None:
    """In a child process: ``records`` of throughput.make_records, round-robin over the partitions."""
    broker = kafkabroker.DevBroker(bootstrap_servers)
    generated = make_records(records, partitions)
    for _ in range(0, records, PRODUCE_CHUNK):
        broker.produce(TOPIC, itertools.islice(generated, PRODUCE_CHUNK))


def produce_all(bootstrap_servers: str, records: int, partitions: int) -> None:
    """``records`` produced by PRODUCERS child processes (their memory stays out of the driver's
    figures), each its share of throughput.make_records (so the shares' values repeat; the
    exactness check counts coordinates, not values)."""
    context = multiprocessing.get_context("spawn")
    shares = [records // PRODUCERS + (n < records % PRODUCERS) for n in range(PRODUCERS)]
    producers = [context.Process(target=produce, args=(bootstrap_servers, share, partitions)) for share in shares]
    for producer in producers:
        producer.start()
    for producer in producers:
        producer.join()
    if any(producer.exitcode for producer in producers):
        sys.exit(f"producing the records failed (exit codes {[producer.exitcode for producer in producers]})")


@dataclass(frozen=True)
class ExecutorSample:
    at: float  # time.time()
    jvm: int  # bytes
    python: tuple[int, ...]  # each Python worker's bytes


def rss(process: psutil.Process, python_only: bool = False) -> int:
    """Its RSS; 0 once it has ended (or, with ``python_only``, when it is no Python process)."""
    try:
        if python_only and "python" not in process.name().lower():
            return 0
        return process.memory_info().rss
    except psutil.Error:
        return 0


class MemorySamples(threading.Thread):
    """Samples every 0.2 s the RSS of the driver (this process and its JVM's process tree) and of
    each executor: its JVM (a child of a worker process) and its Python workers (the JVM's Python
    descendants), by (worker, executor ID, pid). Each sample keeps its time, so a peak can be
    taken over any stretch of the run (a batch)."""

    def __init__(self, driver_jvm_pid: int, workers: list[int]):
        super().__init__(daemon=True)
        self.driver_jvm, self.workers = psutil.Process(driver_jvm_pid), [psutil.Process(w) for w in workers]
        self.driver: list[tuple[float, int]] = []  # (time.time(), bytes)
        self.executors: dict[tuple[int, str, int], list[ExecutorSample]] = {}
        self.running = True

    def run(self) -> None:
        me = psutil.Process()
        while self.running:
            try:
                jvm = [self.driver_jvm, *self.driver_jvm.children(recursive=True)]
            except psutil.Error:
                jvm = []
            self.driver.append((time.time(), sum(map(rss, [me, *jvm]))))
            for number, worker in enumerate(self.workers):
                try:
                    children = worker.children()
                except psutil.Error:
                    continue
                for child in children:
                    try:
                        command = child.cmdline()
                        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" not in command:
                            continue
                        python = tuple(filter(None, (rss(p, python_only=True) for p in child.children(recursive=True))))
                    except psutil.Error:  # a zombie (a worker may keep one), or a process that ended while looked at
                        continue
                    key = (number, command[command.index("--executor-id") + 1], child.pid)
                    self.executors.setdefault(key, []).append(ExecutorSample(time.time(), rss(child), python))
            time.sleep(0.2)

    def driver_peak(self, after: float = 0.0, until: float = float("inf")) -> int:
        return max((size for at, size in self.driver if after <= at <= until), default=0)

    def executor_peaks(self, key, after: float = 0.0, until: float = float("inf")) -> tuple[int, int, int]:
        """The executor's peaks between the two times: its JVM, its Python workers summed, the largest one."""
        samples = [s for s in self.executors[key] if after <= s.at <= until]
        return (max((s.jvm for s in samples), default=0), max((sum(s.python) for s in samples), default=0),
                max((max(s.python, default=0) for s in samples), default=0))

    def python_worker_peak(self, after: float, until: float) -> int:
        """The largest Python worker of any executor between the two times."""
        return max((self.executor_peaks(key, after, until)[2] for key in self.executors), default=0)

    def __enter__(self) -> "MemorySamples":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running = False
        self.join()


def executor_tasks(spark) -> dict[str, dict]:
    """Spark's own account of each executor, by ID (its REST API): tasks done, task time, GC time."""
    context = spark.sparkContext
    with urllib.request.urlopen(f"{context.uiWebUrl}/api/v1/applications/{context.applicationId}/executors",
                                timeout=30) as answer:
        return {e["id"]: e for e in json.load(answer) if e["id"] != "driver"}


def log_ends(broker, partitions: int) -> dict[int, int]:
    futures = broker.admin().list_offsets({TopicPartition(TOPIC, p): OffsetSpec.latest() for p in range(partitions)})
    return {key.partition: future.result(timeout=30).offset for key, future in futures.items()}


def not_exact(pipeline, ends: dict[int, int]) -> str | None:
    """The first partition whose offsets in the table are not [0, log end) once each, or a non-empty
    quarantine table, in one line; None when the table is exact."""
    dataset = DeltaTable(pipeline.sink.table_uri).to_pyarrow_dataset()  # the table's current files
    table = dataset.to_table(columns=[PARTITION_COLUMN, OFFSET_COLUMN])
    stats = table.group_by(PARTITION_COLUMN).aggregate(
        [(OFFSET_COLUMN, "count"), (OFFSET_COLUMN, "count_distinct"), (OFFSET_COLUMN, "min"), (OFFSET_COLUMN, "max")])
    found = {row[PARTITION_COLUMN]: tuple(row[f"{OFFSET_COLUMN}_{f}"] for f in ("count", "count_distinct", "min", "max"))
             for row in stats.to_pylist()}
    for partition in sorted(set(found) | set(ends)):
        end = ends.get(partition)
        count, distinct, low, high = found.get(partition, (0, 0, None, None))
        if end is None or not count == distinct == end or (end and (low, high) != (0, end - 1)):
            expected = "in a partition the topic does not have" if end is None else f"for the log's offsets [0, {end})"
            return (f"topic {TOPIC} partition {partition}: {count:,} rows, {distinct:,} distinct offsets, min {low}, "
                    f"max {high}, {expected}")
    quarantine = pipeline.sink.quarantine_uri
    quarantined = DeltaTable(quarantine).to_pyarrow_dataset().count_rows() if DeltaTable.is_deltatable(quarantine) \
        else 0
    if quarantined:
        return f"topic {TOPIC}: the quarantine table {quarantine} holds {quarantined:,} rows, none expected"
    return None


def batch_figures(pipeline) -> list[tuple[int, int, float, dict]]:
    """Per batch, from its commit records: its records, its ranges, when its last commit landed
    (time.time()) and its profile summed over its commits."""
    batches: dict[int, tuple[int, set, float, dict]] = {}
    for entry in Ledger(pipeline.sink.table_uri, pipeline.name).recent_batches(None):
        record = entry.record
        records, ranges, landed, profile = batches.setdefault(record.batch_seq, (0, set(), 0.0, {}))
        ranges.update(record.partition_ranges())
        for phase, ms in record.profile.items():
            profile[phase] = profile.get(phase, 0) + ms
        batches[record.batch_seq] = (records + record.records["written"], ranges,
                                     max(landed, entry.timestamp_ms / 1000), profile)
    return [(records, len(ranges), landed, profile) for records, ranges, landed, profile in
            (batches[seq] for seq in sorted(batches))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=50_000_000)
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--worker-memory", default="2g", help="each worker's memory (its executor asks 1g)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("oncemore.progress").setLevel(logging.INFO)  # a line per committed part, while it runs
    work = Path(tempfile.mkdtemp(prefix="oncemore-backfill-"))
    try:
        with kafkabroker.running(kafkabroker.start_kafka()) as broker:
            broker.create_topic(TOPIC, args.partitions)
            started = time.perf_counter()
            produce_all(broker.bootstrap_servers, args.records, args.partitions)
            ends = log_ends(broker, args.partitions)
            print(f"produced {sum(ends.values()):,} records to {args.partitions:,} partitions in "
                  f"{time.perf_counter() - started:.0f}s", flush=True)

            # The pipeline's own default limits: commits of at most 1 M records, tasks of at most 1 M.
            limits = Limits()
            pipeline = pipeline_for(broker, TOPIC, str(work / "delta"), limits.max_records_per_commit)
            assert pipeline.limits == limits, "pipeline_for must leave the default limits"
            cluster = start_spark_cluster(cores=1, workers=2, memory=args.worker_memory, log_dir=str(work / "spark"))
            try:
                began = time.perf_counter()
                spark = spark_session(cluster.master_url)
                print(f"Spark standalone cluster: 2 workers of 1 core and {args.worker_memory} each; session on "
                      f"{cluster.master_url} in {time.perf_counter() - began:.1f}s (not counted below)", flush=True)
                from pyspark import SparkContext

                with MemorySamples(SparkContext._gateway.proc.pid, [w.pid for w in cluster.workers]) as memory:
                    run_started_at, began = time.time(), time.perf_counter()
                    report = runner.run(pipeline, spark_factory=lambda: spark)
                    seconds = time.perf_counter() - began
                    began = time.perf_counter()
                    rerun = runner.run(pipeline, spark_factory=lambda: spark)
                    noop_seconds = time.perf_counter() - began
                tasks = executor_tasks(spark)
                spark.stop()
            finally:
                cluster.stop()
            if report.written != sum(ends.values()):
                sys.exit(f"the run wrote {report.written:,} records of {sum(ends.values()):,}")
            if rerun.written or any(b.status == "committed" for b in rerun.batches):
                sys.exit(f"the rerun was no no-op: {rerun.summary()}")

            batches = batch_figures(pipeline)
            phases = {p: report.profile.get(p, 0) / 1000 for p in ("plan", "prepare", "spark_job", "commit")}
            print(f"one run: {report.written:,} records in {len(batches)} batches, {seconds:.1f}s wall = "
                  f"{report.written / seconds:,.0f} rec/s (plan {phases['plan']:.2f}s, prepare {phases['prepare']:.2f}s, "
                  f"Spark jobs {phases['spark_job']:.1f}s, commits {phases['commit']:.1f}s)")
            landed = run_started_at
            for seq, (records, ranges, at, profile) in enumerate(batches):
                ms = {p: profile.get(p, 0) / 1000 for p in ("spark_job", "read", "decode", "write")}
                print(f"  batch {seq}: {records:,} records, {at - landed:.1f}s to its commit: Spark job "
                      f"{ms['spark_job']:.1f}s (tasks' read {ms['read']:.1f}s, decode {ms['decode']:.1f}s, write "
                      f"{ms['write']:.1f}s, summed over both executors; read {1000 * ms['read'] / ranges:.1f} ms a range "
                      f"of {ranges:,}); peak RSS: driver {memory.driver_peak(landed, at) / MIB:,.0f} MiB, largest "
                      f"Python worker {memory.python_worker_peak(landed, at) / MIB:,.0f} MiB", flush=True)
                landed = at
            first_end, last_end = batches[0][2], batches[-1][2]
            last_start = batches[-2][2] if len(batches) > 1 else run_started_at
            for key in sorted(memory.executors):
                (worker, executor, pid), done = key, tasks.get(key[1], {})
                print(f"executor {executor} on worker {worker} (pid {pid}): {done.get('totalTasks', 0)} tasks, "
                      f"{done.get('totalDuration', 0) / 1000:.0f}s task time (GC {done.get('totalGCTime', 0) / 1000:.1f}s); "
                      "peak RSS of its JVM, its Python workers in all and the largest of them:")
                for label, after, until in (("the first batch", 0.0, first_end), ("the last batch", last_start, last_end),
                                            ("the run", 0.0, last_end)):
                    jvm, python_sum, python_max = memory.executor_peaks(key, after, until)
                    print(f"  during {label}: {jvm / MIB:,.0f} MiB, {python_sum / MIB:,.0f} MiB, {python_max / MIB:,.0f} MiB")
            print(f"driver (this process + its JVM) peak: {memory.driver_peak(until=first_end) / MIB:,.0f} MiB during "
                  f"the first batch, {memory.driver_peak(last_start, last_end) / MIB:,.0f} MiB during the last, "
                  f"{memory.driver_peak(until=last_end) / MIB:,.0f} MiB over the run")
            print(f"no-op rerun, warm, in process: {noop_seconds:.2f}s (plan {rerun.profile.get('plan', 0) / 1000:.2f}s) at "
                  f"{args.partitions:,} partitions", flush=True)

            began = time.perf_counter()
            failure = not_exact(pipeline, log_ends(broker, args.partitions))
            if failure:
                sys.exit(f"not exact: {failure}")
            print(f"exact: every (partition, offset) of [0, log end) once in the table, the quarantine empty "
                  f"(counted in {time.perf_counter() - began:.1f}s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
