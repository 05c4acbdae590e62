"""One run end to end: plan -> no-op, or per batch a Spark job that writes files -> commits.

An empty plan returns before pyspark is even imported: a rerun of finished work costs one snapshot
load and a few ListOffsets requests.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .config import SECRET_KEY_PATTERN, OffsetBound, Pipeline
from .kafka import consumer_config
from .ledger import BatchRecord, Ledger
from .planner import LATEST, Batch, Plan, describe, plan_run
from .schema import QUARANTINE_SCHEMA
from .sink import (
    CommitConflict, CommitOutcome, DataFile, TaskSpec, already_committed, commit_batch, delete_files, ensure_table,
    validate_files,
)

log = logging.getLogger("oncemore")


@dataclass
class BatchReport:
    seq: int
    ranges: dict[int, tuple[int, int]]
    status: str  # "committed" | "already_committed" | "lost_race"
    written: int = 0
    quarantined: int = 0
    version: int | None = None
    quarantine_version: int | None = None


@dataclass
class RunReport:
    pipeline: str
    run_id: str
    plan: Plan
    batches: list[BatchReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        if any(b.status == "committed" for b in self.batches):
            return "committed"
        return "no-op"

    @property
    def written(self) -> int:
        return sum(b.written for b in self.batches)

    @property
    def quarantined(self) -> int:
        return sum(b.quarantined for b in self.batches)

    def summary(self) -> str:
        if self.status == "no-op":
            why = "nothing new to ingest" if self.plan.is_empty else "every batch was already committed by another run"
            return f"{self.pipeline}: no-op ({why}) in {self.seconds:.1f}s"
        committed = [b for b in self.batches if b.status == "committed"]
        return (
            f"{self.pipeline}: committed {len(committed)} batch(es), {self.written} records written, "
            f"{self.quarantined} quarantined, table version {committed[-1].version}, in {self.seconds:.1f}s"
        )


def run(
    pipeline: Pipeline,
    until: OffsetBound = LATEST,
    run_id: str | None = None,
    plan: Plan | None = None,
    spark_factory: Callable[[], object] | None = None,
) -> RunReport:
    started = time.monotonic()
    run_id = run_id or f"oncemore-{uuid.uuid4().hex[:12]}"
    plan = plan or plan_run(pipeline, until)
    report = RunReport(pipeline.name, run_id, plan)
    if plan.is_empty:
        report.seconds = time.monotonic() - started
        return report
    log.info("%s", describe(plan))
    main_schema = pipeline.table_schema()
    ensure_table(pipeline.sink.table_uri, main_schema, pipeline.sink.partition_by, pipeline.name,
                 f"oncemore pipeline {pipeline.name}: topic {pipeline.source.topic}")
    ensure_table(pipeline.sink.quarantine_uri, QUARANTINE_SCHEMA, (), f"{pipeline.name}_quarantine",
                 f"oncemore quarantine of pipeline {pipeline.name}: records that failed to decode")
    spark = (spark_factory or spark_session)()
    for batch in plan.batches:
        batch_report = ingest_batch(spark, pipeline, plan, batch, run_id)
        report.batches.append(batch_report)
        log.info("%s: batch %d %s (%d written, %d quarantined)", pipeline.name, batch.seq, batch_report.status,
                 batch_report.written, batch_report.quarantined)
    report.seconds = time.monotonic() - started
    return report


def ingest_batch(spark, pipeline: Pipeline, plan: Plan, batch: Batch, run_id: str) -> BatchReport:
    topic = pipeline.source.topic
    ranges = {r.partition: (r.start, r.end) for r in batch.ranges}
    new_positions = {p: end for p, (_, end) in ranges.items()}
    main = Ledger(pipeline.sink.table_uri, pipeline.name, topic)

    # Checked before the Spark job too, so a finished or conflicting batch costs no work.
    if already_committed(pipeline.sink.table_uri, topic, main.committed_positions(ranges),
                         batch.expected_positions, new_positions):
        return BatchReport(batch.seq, ranges, "already_committed")
    # The quarantine table keeps only rows at or after its own position (heals a crash between
    # the quarantine commit and the main commit).
    quarantine_positions = Ledger(pipeline.sink.quarantine_uri, pipeline.name, topic).committed_positions(ranges)
    floors = {p: max(start, quarantine_positions[p] or 0) for p, (start, _) in ranges.items()}

    files = write_batch_files(spark, pipeline, batch, floors) if batch.offset_count else []
    main_files = [f for f in files if f.table == "main"]
    quarantine_files = [f for f in files if f.table == "quarantine"]
    validate_files(pipeline.sink.table_uri, main_files, pipeline.table_schema(), pipeline.sink.partition_by, ranges)
    validate_files(pipeline.sink.quarantine_uri, quarantine_files, QUARANTINE_SCHEMA, (), ranges)
    written = sum(f.num_records for f in main_files)
    quarantined = sum(f.num_records for f in quarantine_files)

    record = BatchRecord(
        pipeline=pipeline.name,
        batch_seq=batch.seq,
        run_id=run_id,
        until=plan.until,
        ranges={topic: {str(p): [s, e] for p, (s, e) in sorted(ranges.items())}},
        records={"written": written, "quarantined": quarantined},
        gaps=list(batch.gaps),
    )
    quarantine_outcome = CommitOutcome("already_committed", None)
    if quarantine_files:
        touched = {f.kafka_partition for f in quarantine_files}
        quarantine_outcome = _commit(
            pipeline.sink.quarantine_uri, pipeline, quarantine_files,
            {p: quarantine_positions[p] for p in touched}, {p: new_positions[p] for p in touched}, record,
        )
    outcome = _commit(pipeline.sink.table_uri, pipeline, main_files, batch.expected_positions, new_positions, record)
    return BatchReport(batch.seq, ranges, outcome.status, written if outcome.status == "committed" else 0,
                       quarantined if outcome.status == "committed" else 0, outcome.version,
                       quarantine_outcome.version)


def _commit(table_uri, pipeline, files, expected, new_positions, record) -> CommitOutcome:
    try:
        outcome = commit_batch(table_uri, pipeline.name, pipeline.source.topic, files, expected, new_positions, record)
    except CommitConflict:
        delete_files(table_uri, files)  # refused before any commit attempt: these files are ours alone
        raise
    if outcome.status == "already_committed":
        log.warning("%s: %s already holds this range (another run committed it); dropping our files",
                    pipeline.name, table_uri)
        delete_files(table_uri, files)
    elif outcome.status == "lost_race":
        # After a commit attempt the files are left alone; vacuum(full=True) removes them.
        log.warning("%s: %s: a concurrent run committed this range first", pipeline.name, table_uri)
    return outcome


def write_batch_files(spark, pipeline: Pipeline, batch: Batch, quarantine_floors: dict[int, int]) -> list[DataFile]:
    """Runs the Spark job of one batch: each task reads its range, decodes it and writes Parquet
    files; the driver gets back only the files' manifest."""
    from .source import INGEST_NAME, offsets_option  # imports pyspark: only once there is work to do

    topic = pipeline.source.topic
    spec = TaskSpec(
        format_type=pipeline.format.type,
        schema_ddl=pipeline.format.schema,
        table_uri=pipeline.sink.table_uri,
        quarantine_uri=pipeline.sink.quarantine_uri,
        partition_by=pipeline.sink.partition_by,
        quarantine_floors=quarantine_floors,
    )
    reader = (
        spark.read.format(INGEST_NAME)
        .option("pipeline", pipeline.name)
        .option("topic", topic)
        .option("startingOffsets", offsets_option(topic, {r.partition: r.start for r in batch.ranges if r.count}))
        .option("endingOffsets", offsets_option(topic, {r.partition: r.end for r in batch.ranges if r.count}))
        .option("maxRecordsPerPartition", str(pipeline.limits.max_records_per_partition))
        .option("stallTimeoutMs", str(int(pipeline.source.stall_timeout_seconds * 1000)))
        .option("sink", spec.to_json())
    )
    for key, value in consumer_config(pipeline).items():
        reader = reader.option(f"kafka.{key}", value)
    return [DataFile(**row.asDict()) for row in reader.load().collect()]


# ---------------------------------------------------------------------------------------------
# Spark session


def spark_session(master: str | None = None):
    """A Spark session able to run oncemore jobs: the package shipped to executors, the source registered."""
    from pyspark.sql import SparkSession

    from .source import KafkaIngestDataSource, KafkaRangeDataSource

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("oncemore")
    master = master or os.environ.get("ONCEMORE_SPARK_MASTER")
    if master:
        builder = builder.master(master)
    spark = (
        builder.config("spark.sql.session.timeZone", "UTC")
        # librdkafka settings travel as data source options (kafka.*): keep their secrets out of
        # plans, logs and the UI (Spark's default patterns miss sasl.jaas.config).
        .config("spark.redaction.regex", f"(?i){SECRET_KEY_PATTERN}")
        .config("spark.sql.redaction.options.regex", f"(?i){SECRET_KEY_PATTERN}|url")
        .config("spark.sql.execution.arrow.maxRecordsPerBatch", "50000")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    if "oncemore" not in spark.conf.get("spark.submit.pyFiles", ""):
        spark.sparkContext.addPyFile(package_zip())
    spark.dataSource.register(KafkaRangeDataSource)
    spark.dataSource.register(KafkaIngestDataSource)
    return spark


@lru_cache(maxsize=1)
def package_zip() -> str:
    """The oncemore package as a zip for --py-files / addPyFile (executors must not rely on the driver's cwd)."""
    package = Path(__file__).resolve().parent
    target = Path(tempfile.mkdtemp(prefix="oncemore-pkg-")) / "oncemore.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(package.rglob("*.py")):
            archive.write(path, path.relative_to(package.parent))
    return str(target)
