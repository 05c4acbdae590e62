"""How oncemore scales with the range, the cores and the partitions (issue 15, item 5), on the local
Apache Kafka broker (kafkabroker.start_kafka), in one run:

- peak memory of the driver (this process and its JVM) and of Spark's Python workers, for a run
  of 1 M and a run of 10 M records (default limits: commits of 1 M): both should follow the batch
  and task sizes, not the range;
- the same records on Spark ``local[1]`` and ``local[2]`` (warm sessions): the speed-up;
- a topic of 1,000 partitions: planning time, commit time and the bytes each commit adds to the
  Delta log, for the first run and for a run that moves 10 of the 1,000 partitions;
- ``oncemore verify`` of the 10 M-record table: rows per second.

    scripts/benchmark scale [--small 1000000] [--large 10000000] [--partitions 1000]

Not a test: figures, not verdicts.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from devtools import kafkabroker
from oncemore.plan.planner import plan_run
from oncemore.report.verify import verify
from oncemore.run import runner
from oncemore.run.session import spark_session

sys.path.insert(0, str(Path(__file__).parent))
from throughput import make_records, pipeline_for  # noqa: E402  (the same records and pipeline)

MIB = 2**20


class PeakMemory(threading.Thread):
    """Samples the RSS of the driver (this process plus its JVM) and of Spark's Python workers."""

    def __init__(self):
        super().__init__(daemon=True)
        self.driver = self.workers = self.worker = 0
        self.running = True

    def run(self):
        me = psutil.Process()
        while self.running:
            driver, workers = me.memory_info().rss, []
            for child in me.children(recursive=True):
                try:
                    rss = child.memory_info().rss
                    if "java" in child.name().lower():
                        driver += rss
                    elif "python" in child.name().lower():
                        workers.append(rss)
                except psutil.Error:
                    pass
            self.driver = max(self.driver, driver)
            self.workers = max(self.workers, sum(workers))
            self.worker = max([self.worker] + workers)
            time.sleep(0.2)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.join()


def run(pipeline, spark, expected: int | None = None):
    started = time.perf_counter()
    report = runner.run(pipeline, spark_factory=lambda: spark)
    seconds = time.perf_counter() - started
    if expected is not None and report.written != expected:
        sys.exit(f"expected {expected} records written, got {report.written}")
    return report, seconds


def memory(broker, work: str, small: int, large: int) -> None:
    print(f"memory: a run of {small:,} and a run of {large:,} records (commits of at most 1,000,000), local[2]")
    broker.create_topic("range", 2)
    spark = spark_session("local[2]")
    produced = 0
    for size in (small, large):
        broker.produce("range", ((p, k, v, t) for p, k, v, t in make_records(size - produced, 2)))
        produced = size
        pipeline = pipeline_for(broker, "range", f"{work}/memory-{size}", 1_000_000)
        with PeakMemory() as peak:
            report, seconds = run(pipeline, spark, size)
        print(f"  {size:>11,} records, {len(report.batches)} batch(es), {seconds:.1f}s: driver peak "
              f"{peak.driver / MIB:,.0f} MiB (Python + JVM), Python workers peak {peak.workers / MIB:,.0f} MiB "
              f"in all, {peak.worker / MIB:,.0f} MiB the largest", flush=True)
    began = time.perf_counter()
    verified = verify(pipeline, lambda: spark)
    seconds = time.perf_counter() - began
    rows = verified.rows["main"] + verified.rows["quarantine"]
    print(f"oncemore verify of the {size:,}-record table ({verified.commits} commits): {'OK' if verified.ok else 'FAILED'}, "
          f"{rows:,} rows in {seconds:.1f}s = {rows / seconds:,.0f} rows/s, local[2]", flush=True)
    spark.stop()


def parallelism(broker, work: str, records: int) -> None:
    print(f"parallelism: {records:,} records in 4 partitions, a warm session of each size")
    broker.create_topic("cores", 4)
    broker.produce("cores", make_records(records, 4))
    rates = {}
    for master in ("local[1]", "local[2]"):
        spark = spark_session(master)
        run(pipeline_for(broker, "cores", f"{work}/{master}-warmup", records), spark, records)
        _, seconds = run(pipeline_for(broker, "cores", f"{work}/{master}", records), spark, records)
        rates[master] = records / seconds
        print(f"  {master}: {rates[master]:,.0f} rec/s", flush=True)
        spark.stop()
    print(f"  speed-up local[2] / local[1]: {rates['local[2]'] / rates['local[1]']:.2f} x", flush=True)


def log_bytes(table_uri: str, version: int) -> int:
    return (Path(table_uri) / "_delta_log" / f"{version:020d}.json").stat().st_size


def many_partitions(broker, work: str, partitions: int) -> None:
    print(f"a topic of {partitions:,} partitions, 10 records each, local[2]")
    broker.create_topic("wide", partitions)
    broker.produce("wide", make_records(10 * partitions, partitions))
    pipeline = pipeline_for(broker, "wide", work, 10 * partitions)
    spark = spark_session("local[2]")
    for label in (f"first run (all {partitions:,} partitions move)", "a run where 10 partitions move"):
        began = time.perf_counter()
        plan_run(pipeline)
        plan_seconds = time.perf_counter() - began
        report, seconds = run(pipeline, spark)
        versions = [v for b in report.batches for v in b.versions]
        sizes = [log_bytes(pipeline.sink.table_uri, v) for v in versions
                 if (Path(pipeline.sink.table_uri) / "_delta_log" / f"{v:020d}.json").exists()]
        print(f"  {label}: {report.written:,} records, plan {plan_seconds:.2f}s, commit "
              f"{report.profile.get('commit', 0) / 1000:.2f}s, run {seconds:.1f}s, log bytes per commit "
              f"{', '.join(f'{s / 1024:.0f} KiB' for s in sizes)}", flush=True)
        broker.produce("wide", [(p, None, b'{"id": 1}', None) for p in range(10)])
    spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, default=1_000_000)
    parser.add_argument("--large", type=int, default=10_000_000)
    parser.add_argument("--partitions", type=int, default=1000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = tempfile.mkdtemp(prefix="oncemore-scale-")
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        many_partitions(broker, work, args.partitions)
        parallelism(broker, work, args.small)
        memory(broker, work, args.small, args.large)


if __name__ == "__main__":
    main()
