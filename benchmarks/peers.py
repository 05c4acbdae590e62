"""oncemore beside the peer a Spark user would write instead (benchmarks/peer_streaming.py: Structured
Streaming, Spark's Kafka source, from_json/from_avro, a delta-spark sink, Trigger.AvailableNow), in
one run, on the same local Apache Kafka broker, the same topics and the same cores (local[2]).

    scripts/benchmark peers [--records 1000000] [--repeats 3] [--kafka-version 3.9]

Every figure is a whole process, start to exit, as a scheduler starts each (`oncemore run` and
`spark-submit`), or on a resident Spark (a Spark Connect server with the peer's jars, both
connecting as clients), the median of ``repeats`` turns taken in alternation:
- a cold run of 100 records into a new table;
- a warm run of 100 records on the Connect server (after a run that warmed it);
- the bulk marginal rate for flat JSON of about 200 B, nested JSON and Avro (Confluent's wire
  format, a local schema registry): the same records as two topics, half of them and all of them,
  into new tables, so the fixed costs of a run cancel: (all - half) / (time(all) - time(half));
  and the whole run's rate (all / time(all)), fixed costs included;
- the rerun with nothing new;
- a bulk run of flat JSON shaped by a transform (TRANSFORM: Spark SQL over the records, the
  pipeline's ``transform``, the peer's query over the same view): its whole run's rate and peak memory;
- the peak memory of the whole process tree (JVMs and Python workers) during a bulk run: summed RSS
  (a JVM's child between its vfork and its exec shares the JVM's memory and is not counted again),
  and what the JVMs and the Python processes held at that peak; and summed PSS, each page shared by
  several processes (Spark's forked Python workers share their interpreter's and libraries') counted
  once in all, which is what the tree takes of the machine; and both for each format's bulk runs.
Figures, not verdicts: the ratio is oncemore's time over the peer's (its rate over the peer's for
rates); below 1 (above, for rates) oncemore is ahead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pyspark
import yaml
from throughput import AVRO_SCHEMA, FLAT, NESTED, framed_records, make_records, nested_records

from devtools import kafkabroker, sparkjars
from devtools.schemaregistry import start_registry

ROOT = Path(__file__).resolve().parents[1]
PARTITIONS = 4
# A transform as the pipeline docs show one: a column computed, rows filtered.
TRANSFORM = "SELECT *, to_date(_kafka_timestamp) AS day FROM records WHERE amount > 0"
SPARK_SUBMIT = str(Path(pyspark.__file__).parent / "bin" / "spark-submit")


class Tree(threading.Thread):
    """The peak summed RSS of a process and its descendants, sampled while it runs, what each kind
    of process (JVM, Python) held at that peak, and the peak summed PSS."""

    def __init__(self, process: subprocess.Popen):
        super().__init__(daemon=True)
        self.root, self.peak, self.parts, self.pss = psutil.Process(process.pid), 0, {}, 0
        self.start()

    def run(self):
        while True:
            parts: dict[str, list[int]] = {}
            pss = 0
            try:  # the root afresh: psutil keeps the first exe it saw (spark-submit's `env`, before the JVM it becomes)
                if self.root.status() == psutil.STATUS_ZOMBIE:
                    break
                processes = [psutil.Process(self.root.pid), *self.root.children(recursive=True)]
            except psutil.Error:  # ended meanwhile
                break
            for process in processes:
                try:
                    exe = os.path.basename(process.exe())
                    if process.pid != self.root.pid and exe == "java" and process.parent().exe() == process.exe():
                        # A JVM's child between its vfork and its exec (how a JVM starts a process:
                        # Python workers, Hadoop's shell commands): it shares the JVM's memory, and
                        # counting its RSS counted the JVM twice (the peer's 1 M-record peak was 1,657
                        # MiB so, against ~1,010 MiB of processes).
                        continue
                    parts.setdefault("JVM" if exe == "java" else "Python" if exe.startswith("python") else "other",
                                     []).append(process.memory_info().rss)
                    pss += process.memory_full_info().pss
                except psutil.Error:  # ended while looked at
                    pass
            total, self.pss = sum(map(sum, parts.values())), max(self.pss, pss)
            if total > self.peak:
                self.peak, self.parts = total, {kind: (sum(rss), len(rss)) for kind, rss in parts.items()}
            time.sleep(0.05)


def timed(command: list[str], env: dict[str, str]) -> tuple[float, tuple[int, int], dict[str, tuple[int, int]]]:
    """Seconds from start to exit, the process tree's peak summed RSS and PSS, and by kind of
    process (JVM, Python) the RSS and count of processes at the RSS peak; fails on a non-zero exit."""
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = Tree(process)
    out, err = process.communicate()
    seconds = time.perf_counter() - started
    tree.join()
    if process.returncode:
        raise RuntimeError(f"{command[:4]} exited {process.returncode}: {(out + err)[-3000:]}")
    return seconds, (tree.peak, tree.pss), tree.parts


class Bench:
    """The broker, the registry, the work directory, and how each tool is run on a topic."""

    def __init__(self, broker, registry, work: Path):
        self.broker, self.registry, self.work = broker, registry, work
        self.env = {**os.environ, "PYTHONPATH": str(ROOT / "include"), "ONCEMORE_SPARK_MASTER": "local[2]"}
        self.env.pop("SPARK_REMOTE", None)
        self.runs = 0

    def fresh(self, name: str) -> Path:
        self.runs += 1
        return self.work / f"{name}-{self.runs}"

    def oncemore(self, topic: str, fmt: dict, table: Path, remote: str | None = None,
                 transform: str | None = None) -> list[str]:
        config = table.with_suffix(".yaml")
        if not config.exists():
            config.write_text(yaml.safe_dump({
                "name": "peers", "format": fmt, "key": {"type": "string"},
                "source": {"bootstrap_servers": self.broker.bootstrap_servers, "topic": topic},
                "sink": {"table_uri": str(table), "quarantine_uri": f"{table}_quarantine"},
                "limits": {"max_records_per_commit": 10_000_000, "max_records_per_partition": 10_000_000},
                **({"transform": transform} if transform else {})}))
        return [sys.executable, "-m", "oncemore.cli", "run", "--config", str(config),
                *(["--remote", remote] if remote else [])]

    def peer(self, topic: str, fmt: dict, table: Path, remote: str | None = None,
             transform: str | None = None) -> list[str]:
        shape = (["--ddl", fmt["schema"]] if fmt["type"] == "json" else ["--avro-schema", json.dumps(AVRO_SCHEMA)])
        job = [str(ROOT / "benchmarks" / "peer_streaming.py"), "--bootstrap", self.broker.bootstrap_servers,
               "--topic", topic, "--table", str(table), "--checkpoint", f"{table}_checkpoint", *shape,
               *(["--transform", transform] if transform else [])]
        if remote:
            return [sys.executable, *job, "--remote", remote]
        return [SPARK_SUBMIT, "--master", "local[2]", *sparkjars.submit_arguments({"spark.ui.enabled": "false"}), *job]


def turns(repeats: int, runs: dict[str, callable]) -> dict[str, list[tuple[float, int, dict]]]:
    """Each of ``runs`` ``repeats`` times, in alternation: a drift of the machine reaches all alike."""
    found = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            found[name].append(run())
    return found


def median(samples: list[tuple[float, int, dict]]) -> float:
    return statistics.median(s for s, _, _ in samples)


def row(what: str, ours: float, theirs: float, unit: str = "s", higher_is_better: bool = False) -> None:
    ratio = ours / theirs if theirs else float("nan")
    ahead = (ratio > 1) if higher_is_better else (ratio < 1)
    print(f"| {what} | {ours:,.2f} {unit} | {theirs:,.2f} {unit} | {ratio:.2f} x | {'oncemore' if ahead else 'peer'} |",
          flush=True)


def by_kind(parts: dict[str, tuple[int, int]]) -> str:
    """What each kind of process held at a peak (``timed``'s RSS and count by kind), as one line."""
    return ", ".join(f"{kind} {rss / 2**20:,.0f} MiB in {count} process{'es' * (count > 1)}"
                     for kind, (rss, count) in sorted(parts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    kafkabroker.add_kafka_version_option(parser, "of the local broker")
    args = parser.parse_args()
    n, repeats = args.records, args.repeats
    work = Path(tempfile.mkdtemp(prefix="oncemore-peers-"))
    broker, registry = kafkabroker.start_kafka(version=args.kafka_version), start_registry()
    server = None
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
        from confluent_kafka.schema_registry.avro import AvroSerializer
        from confluent_kafka.serialization import MessageField, SerializationContext

        bench = Bench(broker, registry, work)
        avro_fmt = {"type": "avro", "schema_registry": registry.settings()}
        serializer = AvroSerializer(SchemaRegistryClient(registry.settings()), json.dumps(AVRO_SCHEMA))
        produced = {"flat": lambda count, topic: make_records(count, PARTITIONS),
                    "nested": lambda count, topic: nested_records(count, PARTITIONS),
                    "avro": lambda count, topic: framed_records(  # the subject is the topic's: <topic>-value
                        lambda value: serializer(value, SerializationContext(topic, MessageField.VALUE)),
                        count, PARTITIONS)}
        formats = {"flat": FLAT, "nested": NESTED, "avro": avro_fmt}
        print(f"oncemore vs Structured Streaming + delta-spark, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, "
              f"local[2], Apache Kafka {kafkabroker.kafka_full_version(args.kafka_version)} on this machine, "
              f"{n:,} records a bulk run, median of {repeats}", flush=True)
        print("\n| what | oncemore | peer | ratio | ahead |\n|---|---|---|---|---|")

        broker.create_topic("small", PARTITIONS)
        broker.produce("small", make_records(100, PARTITIONS))
        cold_tables = {"oncemore": [], "peer": []}

        def cold(tool: str):
            cold_tables[tool].append(bench.fresh(f"cold-{tool}"))
            return timed(getattr(bench, tool)("small", FLAT, cold_tables[tool][-1]), bench.env)

        colds = turns(repeats, {"oncemore": lambda: cold("oncemore"), "peer": lambda: cold("peer")})
        row("cold run, 100 records, process start to exit", median(colds["oncemore"]), median(colds["peer"]))

        noop = turns(repeats, {tool: (lambda tool=tool: timed(getattr(bench, tool)("small", FLAT, cold_tables[tool][0]),
                                                              bench.env)) for tool in cold_tables})
        row("rerun with nothing new", median(noop["oncemore"]), median(noop["peer"]))

        server = sparkjars.start_delta_connect_server("local[2]", log_dir=str(work / "connect"))
        broker.create_topic("warm", PARTITIONS)
        warm_tables = {"oncemore": bench.fresh("warm"), "peer": bench.fresh("warm-peer")}

        def warm(tool: str):
            broker.produce("warm", make_records(100, PARTITIONS))
            command = getattr(bench, tool)("warm", FLAT, warm_tables[tool], remote=server.url)
            timed(command, bench.env)  # the warm-up: this tool's first run in the server, and the records it reads
            broker.produce("warm", make_records(100, PARTITIONS))
            return timed(command, bench.env)

        warmed = turns(repeats, {"oncemore": lambda: warm("oncemore"), "peer": lambda: warm("peer")})
        row("warm run, 100 records, on a Spark Connect server", median(warmed["oncemore"]), median(warmed["peer"]))
        server.stop()
        server = None

        memory = {"oncemore": ((0, 0), {}), "peer": ((0, 0), {})}
        pss = {"oncemore": 0, "peer": 0}
        by_format = {"oncemore": {}, "peer": {}}  # the peak summed RSS and PSS of each format's bulk runs
        for name, fmt in formats.items():
            sizes = {"half": n // 2, "all": n}
            for size, count in sizes.items():
                topic = f"{name}_{size}"
                broker.create_topic(topic, PARTITIONS)
                broker.produce(topic, produced[name](count, topic))
            found = turns(repeats, {
                f"{tool} {size}": (lambda tool=tool, size=size: timed(
                    getattr(bench, tool)(f"{name}_{size}", fmt, bench.fresh(f"{name}-{size}-{tool}")), bench.env))
                for tool in ("oncemore", "peer") for size in sizes})
            rates = {tool: (n - n // 2) / (median(found[f"{tool} all"]) - median(found[f"{tool} half"]))
                     for tool in ("oncemore", "peer")}
            what = f"{name} JSON" if name != "avro" else "Avro (registry)"
            row(f"bulk marginal rate, {what}", rates["oncemore"], rates["peer"], "rec/s", higher_is_better=True)
            # Whole runs too: where a tool's extra time for the second half is small beside the
            # spread of its fixed costs, the marginal rate says little.
            row(f"whole run of {n:,} records, {what}, fixed costs included", n / median(found["oncemore all"]),
                n / median(found["peer all"]), "rec/s", higher_is_better=True)
            for tool in memory:
                peaks = [(peak, parts) for _, peak, parts in found[f"{tool} all"]]
                by_format[tool][what] = (max(rss for (rss, _), _ in peaks), max(pss_ for (_, pss_), _ in peaks))
                memory[tool] = max([memory[tool]] + peaks, key=lambda m: m[0][0])
                pss[tool] = max([pss[tool]] + [peak[1] for peak, _ in peaks])
        row(f"peak memory of a bulk run ({n:,} records), process tree, summed RSS", memory["oncemore"][0][0] / 2**20,
            memory["peer"][0][0] / 2**20, "MiB")
        row(f"peak memory of a bulk run ({n:,} records), process tree, summed PSS", pss["oncemore"] / 2**20,
            pss["peer"] / 2**20, "MiB")
        shaped = turns(repeats, {tool: (lambda tool=tool: timed(getattr(bench, tool)(
            "flat_all", FLAT, bench.fresh(f"shaped-{tool}"), transform=TRANSFORM), bench.env)) for tool in memory})
        row(f"whole run of {n:,} records, flat JSON through a transform", n / median(shaped["oncemore"]),
            n / median(shaped["peer"]), "rec/s", higher_is_better=True)
        shaped_peak = {tool: max(((peak, parts) for _, peak, parts in runs), key=lambda m: m[0][0])
                       for tool, runs in shaped.items()}
        row(f"peak memory of a run through a transform ({n:,} records), summed RSS", shaped_peak["oncemore"][0][0] / 2**20,
            shaped_peak["peer"][0][0] / 2**20, "MiB")
        shaped_pss = {tool: max(peak[1] for _, peak, _ in runs) for tool, runs in shaped.items()}
        row(f"peak memory of a run through a transform ({n:,} records), summed PSS", shaped_pss["oncemore"] / 2**20,
            shaped_pss["peer"] / 2**20, "MiB")
        for tool, (_, parts) in memory.items():
            print(f"\n{tool}'s peak: {by_kind(parts)}")
            print(f"{tool}'s peaks by format, summed RSS / PSS: " + ", ".join(
                f"{what} {rss / 2**20:,.0f} / {pss_ / 2**20:,.0f} MiB" for what, (rss, pss_) in by_format[tool].items()))
            print(f"{tool}'s peak through a transform: {by_kind(shaped_peak[tool][1])}")
    finally:
        if server is not None:
            server.stop()
        registry.stop()
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
