"""Ingestion throughput: the oncemore pipeline next to a raw single-process confluent-kafka consume
of the same offsets, in one run, on a local Apache Kafka broker (kafkabroker.start_kafka(): 4.4, or
3.9 with ``--kafka-version 3.9``).

    scripts/benchmark [--records 1000000] [--few N] [--partitions 4] [--formats] [--kafka-version 3.9]

Prints records/s for each, and the ratios of their marginal rates: each is measured on the first
``--few`` records (default: half of every partition) and on all of them, five times each in one
run (the pipeline after a small warm-up run), and the extra records over the extra time of the
median runs is the marginal rate, so a run's fixed costs (planning, Spark scheduling, the commit)
cancel; the range of each turn's own ratio is printed beside it. For the pipeline, also where the
extra time went: per phase of its runs' profiles (core/stopwatch.py: the Spark job's wall clock;
the tasks' read, decode and write, summed over the tasks; the commit), the median extra. The raw consume is measured as a plain loop (issue 15's
yardstick) and with Python's garbage collector paused (as oncemore's tasks run). So is a floor:
the same ranges in two processes, one per core, doing the least that writing them as Parquet
takes (read as oncemore reads a range, with the collector paused; Arrow's JSON reader and
Parquet row groups of oncemore's sizes; no checks of the values, no keys or timestamps, no Spark,
no Delta), what any ingestion into Parquet pays on these cores. The four take turns, so a drift
in the machine's speed reaches them alike. Also the peak memory of Spark's Python workers (it
should follow the batch size, not the range size). With ``--formats``, the same number of records
again as flat JSON through a transform (records through Spark DataFrames), nested JSON, Avro and
Protobuf (Confluent's wire format, a local schema registry), each warm and measured alone after
the flat JSON (not in turns with the raw consume). Not a test: figures, not verdicts.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import logging
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
from confluent_kafka import Message, TopicPartition

from devtools import kafkabroker
from oncemore.config.loading import parse_pipeline
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.ddl import parse_ddl
from oncemore.kafka.batches import BATCH_ROWS
from oncemore.kafka.clients import consumer_config, range_consumer, read_messages
from oncemore.plan.planner import LATEST
from oncemore.run import runner
from oncemore.run.session import spark_session
from oncemore.write.files import ROW_GROUP_ROWS


def make_records(count: int, partitions: int):
    rng = random.Random(7)
    padding = "x" * 120
    for i in range(count):
        value = json.dumps({"id": i, "customer": f"customer-{rng.randrange(10_000):05d}",
                            "amount": round(rng.random() * 1000, 2), "note": padding}).encode()
        yield i % partitions, str(i).encode(), value, None


def raw_consume(pipeline, ends: dict[KafkaPartition, int], collector: bool = True) -> tuple[int, float]:
    """One process, one consumer, all partitions from offset 0 to ``ends``: the rate oncemore is
    measured against. With ``collector`` off, Python's cyclic garbage collector is paused while it
    reads, as oncemore's tasks do (run/workermemory.py): the client's messages are objects it tracks, and
    a plain loop spends about a third of its time collecting."""
    if not collector:
        gc.disable()
    try:
        started = time.perf_counter()  # the consumer's creation and close included, as in the floor and the pipeline
        with range_consumer(consumer_config(pipeline), pipeline.name) as consumer:
            consumer.assign([TopicPartition(p.topic, p.partition, 0) for p in ends])
            remaining = {p.partition: end for p, end in ends.items()}
            count = 0
            while remaining:
                for message in consumer.consume(10_000, 1.0):
                    if message.error():
                        raise RuntimeError(message.error())
                    end = remaining.get(message.partition())
                    if end is not None and message.offset() < end:
                        count += 1
                        len(message.value())  # a consumer looks at the value
                        if message.offset() + 1 >= end:
                            remaining.pop(message.partition())
        elapsed = time.perf_counter() - started
    finally:
        gc.enable()
    return count, elapsed


def floor_task(config: dict[str, str], stall_timeout: float, topic: str, partition: int, end: int, schema: pa.Schema,
               path: str) -> int:
    """One range [0, end) through the least that writing it as Parquet takes, in one of the floor's
    processes: read as oncemore reads a range (``read_messages``: errors and stalls named), with the
    collector paused; the values of BATCH_ROWS records joined as lines for Arrow's JSON reader (no
    check that they are one JSON object each), their offsets beside; row groups of ROW_GROUP_ROWS
    in one Parquet file, plain-encoded (faster to write than dictionaries, larger files). No keys,
    timestamps or quarantine, no Spark, no Delta. The rows written."""
    gc.disable()
    try:
        with range_consumer(config, "floor") as consumer, \
                pq.ParquetWriter(path, schema.append(pa.field("offset", pa.int64())), compression="snappy",
                                 use_dictionary=False) as writer:
            parsed: list[pa.Table] = []  # the next row group
            written = 0
            for lines, offsets in _joined_batches(read_messages(consumer, topic, partition, 0, end, stall_timeout, "floor")):
                table = pajson.read_json(pa.BufferReader(lines), read_options=pajson.ReadOptions(
                    use_threads=False, block_size=len(lines) + 1), parse_options=pajson.ParseOptions(
                    explicit_schema=schema, unexpected_field_behavior="ignore"))
                parsed.append(table.append_column("offset", pa.array(offsets)))
                if sum(t.num_rows for t in parsed) >= ROW_GROUP_ROWS:
                    written += _write_row_group(writer, parsed)
                    parsed = []
            if parsed:
                written += _write_row_group(writer, parsed)
        return written
    finally:
        gc.enable()


def _joined_batches(lists: Iterable[list]) -> Iterator[tuple[bytes, np.ndarray]]:
    """The messages of ``lists`` BATCH_ROWS at a time: their values joined as lines, their offsets."""
    values: list[bytes] = []
    offsets: list[int] = []
    for messages in lists:
        values += map(Message.value, messages)
        offsets += map(Message.offset, messages)
        if len(values) >= BATCH_ROWS:
            yield b"\n".join(values), np.array(offsets, np.int64)
            values, offsets = [], []
    if values:
        yield b"\n".join(values), np.array(offsets, np.int64)


def _write_row_group(writer: pq.ParquetWriter, tables: list[pa.Table]) -> int:
    rows = pa.concat_tables(tables)
    writer.write_table(rows, row_group_size=rows.num_rows)
    return rows.num_rows


def floor_timer(pipeline, pool, work: str, n: int, parts: int, topic: str):
    """A timer for ``marginal`` running floor_task over each range in ``pool`` (two processes),
    after a small run (the processes' imports and first consumers)."""
    config, stall_timeout = consumer_config(pipeline), pipeline.source.stall_timeout_seconds
    schema, runs = parse_ddl(pipeline.format.ddl), itertools.count()

    def timed(ends):
        directory = f"{work}/floor-{next(runs)}"
        os.makedirs(directory)
        started = time.perf_counter()
        written = sum(pool.starmap(floor_task, [(config, stall_timeout, p.topic, p.partition, end, schema,
                                                 f"{directory}/{p.partition}.parquet") for p, end in ends.items()],
                                   chunksize=1))
        elapsed = time.perf_counter() - started
        shutil.rmtree(directory)
        if written != sum(ends.values()):
            sys.exit(f"floor: expected {sum(ends.values())} records written, got {written}")
        return written, elapsed

    timed(warmup_ends(topic, n, parts))
    return timed


def first_ends(topic: str, records: int, parts: int) -> dict[KafkaPartition, int]:
    """The ends of the first ``records`` of a topic produced round-robin over ``parts`` partitions,
    no transactions: ``records // parts`` of each partition."""
    return {KafkaPartition(topic, p): records // parts for p in range(parts)}


def warmup_ends(topic: str, n: int, parts: int) -> dict[KafkaPartition, int]:
    """The small first run a timer makes, uncounted: what a process or a session pays once."""
    return {p: min(1_000, e) for p, e in first_ends(topic, n // 2, parts).items()}


@dataclass(frozen=True)
class Rates:
    whole: float  # records/s of the whole range (median run)
    marginal: float  # the second half's records over the extra time of the median runs
    extra_seconds: tuple[float, ...]  # each turn's extra time for the second half

    def ratio(self, other: "Rates") -> str:
        """This marginal rate over ``other``'s, and the range of the turns' own ratios (turn i of
        one timer next to turn i of the other: the same records, so the inverse ratio of their
        extra times; a turn whose whole range took no longer than its half has none)."""
        each = [theirs / mine for mine, theirs in zip(self.extra_seconds, other.extra_seconds, strict=True)
                if mine > 0 and theirs > 0]
        spread = f"turns {min(each):.2f}-{max(each):.2f} x" if each else "no turn measurable"
        if each and len(each) < len(self.extra_seconds):
            spread += f", {len(self.extra_seconds) - len(each)} not measurable"
        return f"{self.marginal / other.marginal:.2f} x ({spread})"


def marginal(timers: dict[str, Callable], n: int, parts: int, topic: str, few: int, repeats: int = 5) -> dict[str, Rates]:
    """Per timer, its Rates: ``timed(ends)`` -> (records, seconds) on the first ``few`` of the ``n``
    records and on all of them. The timers take turns, ``repeats`` times, so a drift in the
    machine's speed (a shared VM's varied by a third within minutes) reaches them all alike. The
    marginal rate is the extra records over the extra time of the median runs, so the fixed costs
    of a run (planning, scheduling, the commit) cancel, and one slow run does not decide it."""
    half = first_ends(topic, few, parts)
    full = first_ends(topic, n, parts)
    runs: dict[str, tuple[list, list]] = {name: ([], []) for name in timers}
    for _ in range(repeats):
        for name, timed in timers.items():
            runs[name][0].append(timed(half))
            runs[name][1].append(timed(full))
    return {name: _rates(name, few, many) for name, (few, many) in runs.items()}


def _rates(name: str, few: list[tuple[int, float]], many: list[tuple[int, float]]) -> Rates:
    few_records, few_seconds = few[0][0], statistics.median(s for _, s in few)
    many_records, many_seconds = many[0][0], statistics.median(s for _, s in many)
    if many_seconds <= few_seconds:
        sys.exit(f"{name}: all of the records took no longer than the first few ({many_seconds:.2f}s vs "
                 f"{few_seconds:.2f}s): too few records to measure a rate; use more --records")
    return Rates(many_records / many_seconds, (many_records - few_records) / (many_seconds - few_seconds),
                 tuple(m - f for (_, f), (_, m) in zip(few, many, strict=True)))


class PeakWorkerMemory(threading.Thread):
    """Samples the summed RSS of Spark's Python workers: this process's Python descendants except its
    own children (the floor's pool and its resource tracker, a schema registry)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak_bytes, self.peak_single, self.running = 0, 0, True

    def run(self):
        me = psutil.Process()
        while self.running:
            sizes = []
            for process in me.children(recursive=True):
                try:  # a worker may end while it is looked at
                    if "python" in process.name().lower() and process.ppid() != me.pid:
                        sizes.append(process.memory_info().rss)
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, sum(sizes))
            self.peak_single = max([self.peak_single] + sizes)
            time.sleep(0.2)


FLAT = {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE, note STRING"}
NESTED = {"type": "json", "schema": "id BIGINT, customer STRUCT<name: STRING, address: STRUCT<zip: STRING, city: STRING>>, "
                                    "lines ARRAY<STRUCT<sku: STRING, price: DECIMAL(10,2)>>, placed TIMESTAMP"}
AVRO_SCHEMA = {"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "long"}, {"name": "customer", "type": "string"}, {"name": "amount", "type": "double"},
    {"name": "note", "type": "string"}]}


def pipeline_for(broker, topic: str, table_dir: str, records: int, format_=FLAT, **extra):
    return parse_pipeline({
        "name": "bench",
        "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic},
        "sink": {"table_uri": f"{table_dir}/{topic}", "quarantine_uri": f"{table_dir}/{topic}_quarantine"},
        "format": format_,
        "limits": {"max_records_per_commit": records, "max_records_per_partition": records},
        **extra,
    }, "benchmark", {})


def nested_records(count: int, partitions: int):
    for i in range(count):
        value = json.dumps({"id": i, "customer": {"name": f"customer-{i % 10_000:05d}", "address": {"zip": f"{i % 99_999:05d}",
                                                                                                    "city": "Oslo"}},
                            "lines": [{"sku": f"s{i % 500}", "price": f"{i % 1000}.25"}], "placed": "2026-11-20T10:00:00Z"})
        yield i % partitions, None, value.encode(), None


def framed_records(serialize, count: int, partitions: int):
    rng = random.Random(7)
    for i in range(count):
        yield i % partitions, None, serialize({"id": i, "customer": f"customer-{rng.randrange(10_000):05d}",
                                               "amount": round(rng.random() * 1000, 2), "note": "x" * 120}), None


def protobuf_order():
    """An Order message like the flat JSON's, built at run time (no generated code)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from google.protobuf.descriptor_pb2 import FieldDescriptorProto as Field

    proto = descriptor_pb2.FileDescriptorProto(name="bench_order.proto", package="bench", syntax="proto3")
    message = proto.message_type.add(name="Order")
    for number, (name, kind) in enumerate([("id", Field.TYPE_INT64), ("customer", Field.TYPE_STRING),
                                           ("amount", Field.TYPE_DOUBLE), ("note", Field.TYPE_STRING)], 1):
        message.field.add(name=name, number=number, type=kind, label=Field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.Order"))


def formats(broker, spark, work: str, n: int, parts: int, plain_rate: float, paused_rate: float) -> None:
    """Warm throughput of every way records travel, on the same number of ~200 B records, next to
    the raw consume's marginal rates as a plain loop and with the collector paused."""
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from devtools.schemaregistry import start_registry

    registry = start_registry()
    try:
        client = SchemaRegistryClient(registry.settings())
        avro = AvroSerializer(client, json.dumps(AVRO_SCHEMA))
        order = protobuf_order()
        protobuf = ProtobufSerializer(order, client, {"use.deprecated.format": False})
        cases = [
            ("flat JSON through a transform (Spark DataFrames)", "bench", FLAT,
             {"transform": "SELECT * FROM records"}, None),
            ("nested JSON", "bench_nested", NESTED, {}, lambda: nested_records(n, parts)),
            ("Avro (registry)", "bench_avro", {"type": "avro", "schema_registry": registry.settings()}, {},
             lambda: framed_records(lambda v: avro(v, SerializationContext("bench_avro", MessageField.VALUE)), n, parts)),
            ("Protobuf (registry)", "bench_proto", {"type": "protobuf", "schema_registry": registry.settings()}, {},
             lambda: framed_records(lambda v: protobuf(order(**v), SerializationContext("bench_proto", MessageField.VALUE)),
                                    n, parts)),
        ]
        for label, topic, format_, extra, produce in cases:
            if produce is not None:
                broker.create_topic(topic, parts)
                broker.produce(topic, produce())
            timed, _ = pipeline_timer(
                lambda size: pipeline_for(broker, topic, f"{work}/{label.split()[0]}-{size}", n, format_, **extra),
                spark, n, parts, topic)
            rates = marginal({label: timed}, n, parts, topic, n // 2)[label]
            print(f"  {label}: {rates.whole:,.0f} rec/s whole run, marginal {rates.marginal:,.0f} rec/s = "
                  f"{rates.marginal / plain_rate:.2f} x the plain raw loop, {rates.marginal / paused_rate:.2f} x the paused one",
                  flush=True)
    finally:
        registry.stop()


def timed_run(pipeline, spark, ends: dict[KafkaPartition, int] | None = None) -> tuple[int, float, PeakWorkerMemory,
                                                                                       dict[str, int]]:
    """Runs ``pipeline`` (up to ``ends``, else to the end) into its fresh table: (records, seconds,
    memory, the run's profile in ms per phase)."""
    until = LATEST if ends is None else OffsetBound(kind="offsets", offsets={(p.topic, p.partition): e for p, e in ends.items()})
    memory = PeakWorkerMemory()
    memory.start()
    started = time.perf_counter()
    report = runner.run(pipeline, until=until, spark_factory=lambda: spark)
    seconds = time.perf_counter() - started
    memory.running = False
    expected = sum(ends.values()) if ends is not None else None
    if expected is not None and report.written != expected:
        sys.exit(f"expected {expected} records written, got {report.written}")
    return report.written, seconds, memory, report.profile


# The phases of a run's profile (core/stopwatch.py) that grow with its records.
STAGES = (("spark_job", "Spark job (wall)"), ("read", "tasks' Kafka read"), ("decode", "decode"), ("write", "Parquet write"),
          ("validate", "validate"), ("commit", "commit"))


def stage_split(runs: list, records: int) -> str:
    """Where the pipeline's extra time went: per phase, the median over the turns of the larger
    run's time less the smaller's (``runs`` alternate: smaller, larger), and per record. The
    tasks' phases are task time, summed over the tasks that ran side by side."""
    pairs = list(zip(runs[0::2], runs[1::2], strict=True))
    extra = {phase: statistics.median(large[3].get(phase, 0) - small[3].get(phase, 0) for small, large in pairs) / 1000
             for phase, _ in STAGES}
    return "; ".join(f"{label} {extra[phase]:.2f}s = {extra[phase] * 1e9 / records:,.0f} ns a record"
                     for phase, label in STAGES)


def pipeline_timer(make, spark, n: int, parts: int, topic: str):
    """A timer for ``marginal`` running the pipeline ``make(label)`` makes, each run into a fresh
    table, and the list of its runs (records, seconds, memory)."""
    # A first run pays what a session does once per data source or path (its Python workers,
    # the sink's registration): a small one goes first, uncounted.
    timed_run(make("warmup"), spark, warmup_ends(topic, n, parts))
    runs = []

    def timed(ends):
        runs.append(timed_run(make(f"run{len(runs)}"), spark, ends))
        return runs[-1][:2]

    return timed, runs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--few", type=int, help="the smaller runs' records (default: half of --records)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--formats", action="store_true", help="also the transform path, nested JSON, Avro, Protobuf")
    kafkabroker.add_kafka_version_option(parser, "of the local broker")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    n, parts = args.records, args.partitions
    few = args.few if args.few is not None else n // 2
    mib = 2**20

    work = tempfile.mkdtemp(prefix="oncemore-bench-")
    try:
        with kafkabroker.running(kafkabroker.start_kafka(version=args.kafka_version)) as broker:
            print(f"on Apache Kafka {kafkabroker.kafka_full_version(args.kafka_version)} (a local single-node broker)",
                  flush=True)
            started = time.perf_counter()
            for topic, count in (("bench", parts), ("bench_one", 1)):
                broker.create_topic(topic, count)
                broker.produce(topic, make_records(n, count))
            print(f"produced 2 x {n} records in {time.perf_counter() - started:.1f}s", flush=True)
            pipeline = pipeline_for(broker, "bench", work, n)
            avg_size = sum(len(v) for _, _, v, _ in make_records(1000, 1)) / 1000

            print(f"{n} records of ~{avg_size:.0f} B", flush=True)
            session_started = time.perf_counter()
            spark = spark_session("local[2]")
            print(f"SparkSession start: {time.perf_counter() - session_started:.1f}s (not counted below)", flush=True)
            written, seconds, _, _ = timed_run(pipeline, spark)
            timed, runs = pipeline_timer(lambda label: pipeline_for(broker, "bench", f"{work}/{label}", n), spark,
                                         n, parts, "bench")
            plain, paused, floor = "raw consume as a plain loop", "raw consume with the collector paused", "floor"
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                rates = marginal({plain: functools.partial(raw_consume, pipeline),
                                  paused: functools.partial(raw_consume, pipeline, collector=False),
                                  floor: floor_timer(pipeline, pool, work, n, parts, "bench"), "pipeline": timed},
                                 n, parts, "bench", few)
            print(f"marginal rates: {n - few:,} records more than the first {few:,} (each run of the pipeline into a "
                  "fresh table)")
            for name in (plain, paused):
                print(f"{name} (confluent-kafka, 1 process): {rates[name].whole:,.0f} rec/s, "
                      f"marginal {rates[name].marginal:,.0f} rec/s")
            print("floor (2 processes: consume with the collector paused, Arrow's JSON reader, Parquet; no checks, "
                  f"no Spark, no Delta): {rates[floor].whole:,.0f} rec/s, marginal {rates[floor].marginal:,.0f} rec/s = "
                  f"{rates[floor].ratio(rates[paused])} the paused raw consume")
            mine = rates["pipeline"]
            # One task reading the whole range: memory must follow the batch size, not the range.
            _, _, single_memory, _ = timed_run(pipeline_for(broker, "bench_one", f"{work}/one", n), spark)
            print("oncemore pipeline (Kafka read + JSON parse + Parquet + Delta commit), Spark local[2]:")
            print(f"  first job in a fresh session: {written / seconds:,.0f} rec/s (whole run)")
            print(f"  session warm: {mine.whole:,.0f} rec/s whole run, marginal {mine.marginal:,.0f} rec/s", flush=True)
            print(f"  the extra {n - few:,} records, per phase: {stage_split(runs, n - few)}", flush=True)
            print(f"  Python worker peak RSS: {runs[-1][2].peak_single / mib:.0f} MiB with {n // parts} records per task, "
                  f"{single_memory.peak_single / mib:.0f} MiB with {n} records in one task "
                  f"({n * avg_size / mib:.0f} MiB of values)", flush=True)
            print(f"flat JSON, marginal: {mine.ratio(rates[plain])} the raw consume as a plain loop; "
                  f"{mine.ratio(rates[paused])} the paused one; {mine.ratio(rates[floor])} the floor", flush=True)
            if args.formats:
                formats(broker, spark, work, n, parts, rates[plain].marginal, rates[paused].marginal)
            spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)  # tables of every run: gigabytes at 2 M records


if __name__ == "__main__":
    main()
