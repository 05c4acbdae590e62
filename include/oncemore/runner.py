"""One run end to end: plan -> no-op, or per batch Spark jobs that write files -> commits.

A batch runs from the table's *current* positions to its planned ends, so a retried, rerun or
partly committed plan does exactly the part the table does not hold yet, and a plan the table
already holds is a no-op that never starts Spark. Byte budgets may cut a batch short: the part
read is committed, and the rest of the batch follows in the next commit of the same batch_seq.
An empty plan returns before pyspark is even imported.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from . import kafka
from .committer import CommitOutcome, commit, covered_prefix, delete_files, ensure_tables, validate_files
from .config import OffsetBound, Pipeline
from .errors import CommitConflict, StalePlan, TaskFailed, TopicChanged, root_cause
from .group_mirror import mirror_positions
from .kafka import consumer_config
from .commitrecord import CommitRecord
from .coordinates import KafkaPartition, by_text, nested
from .ledger import Ledger
from .planner import LATEST, Batch, OffsetRange, Plan, describe, group_tasks, plan_run, split_tasks
from .progress import Progress
from .schema import QUARANTINE_SCHEMA
from .storage import table_location
from .writer import RangeResult, TaskSpec

log = logging.getLogger("oncemore")


@dataclass
class BatchReport:
    seq: int
    ranges: dict[KafkaPartition, tuple[int, int]]
    status: str = "already_committed"  # "committed" once one of its commits is ours
    written: int = 0
    quarantined: int = 0
    versions: list[int] = field(default_factory=list)
    quarantine_versions: list[int] = field(default_factory=list)


@dataclass
class RunReport:
    pipeline: str
    run_id: str
    plan: Plan
    batches: list[BatchReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return "committed" if any(b.status == "committed" for b in self.batches) else "no-op"

    @property
    def written(self) -> int:
        return sum(b.written for b in self.batches)

    @property
    def quarantined(self) -> int:
        return sum(b.quarantined for b in self.batches)

    def summary(self) -> str:
        if self.status == "no-op":
            why = "nothing new to ingest" if self.plan.is_empty else "the table already holds this plan"
            return f"{self.pipeline}: no-op ({why}) in {self.seconds:.1f}s"
        committed = [b for b in self.batches if b.status == "committed"]
        return (
            f"{self.pipeline}: committed {len(committed)} batch(es), {self.written} records written, "
            f"{self.quarantined} quarantined, table version {max(committed[-1].versions)}, in {self.seconds:.1f}s"
        )


def _ranges(batch: Batch) -> dict[KafkaPartition, tuple[int, int]]:
    return {r.key: (r.start, r.end) for r in batch.ranges}


class _Run:
    """The state of one run: the pipeline's two ledgers, the Spark session once needed, and what
    this run has learned of its partitions' record sizes."""

    def __init__(self, pipeline: Pipeline, plan: Plan, run_id: str, spark_factory: Callable[[], object]):
        self.pipeline, self.plan, self.run_id = pipeline, plan, run_id
        options = pipeline.sink.storage_options
        self.main = Ledger(pipeline.sink.table_uri, pipeline.name, options)
        self.quarantine = Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)
        self.where = f"pipeline {pipeline.name}"
        self._spark_factory, self._spark = spark_factory, None
        self.bytes_per_offset: dict[KafkaPartition, float] = {}
        self.progress: Progress | None = None

    @property
    def spark(self):
        if self._spark is None:
            self._spark = self._spark_factory()
        return self._spark

    def holds(self, batch: Batch) -> bool:
        """The table already holds the whole batch (a retry or rerun of finished work)."""
        positions = self.main.positions(batch.expected_positions)
        return all(positions[r.key] is not None and positions[r.key] >= r.end for r in batch.ranges)

    def offsets_left(self, batches: list[Batch]) -> int:
        """Offsets of ``batches`` the table does not hold yet."""
        positions = self.main.positions(self.plan.ends())
        return sum(max(r.end - max(r.start, positions[r.key] or 0), 0) for b in batches for r in b.ranges)

    def ingest(self, batch: Batch) -> BatchReport:
        report = BatchReport(batch.seq, _ranges(batch))
        partitions = sorted(self.plan.bounds)
        while True:
            positions = self.main.positions(batch.expected_positions)
            left = batch.remaining(positions, self.where)
            if not left:
                return report
            quarantine_before = self.quarantine.positions(left)
            self._ingest_part(batch, positions, left, partitions, report)
            # A part that lost a race moves the other run's positions; one that moves nothing at all
            # would go round forever.
            if (self.main.positions(batch.expected_positions) == positions
                    and self.quarantine.positions(left) == quarantine_before):
                raise CommitConflict(f"{self.where}: batch {batch.seq} made no progress from {by_text(positions)}",
                                     positions=by_text(positions))

    def _ingest_part(self, batch: Batch, positions, left: dict[KafkaPartition, OffsetRange], partitions,
                     report: BatchReport) -> None:
        """Reads what is left of the batch (up to the byte budgets) and commits what was read."""
        pipeline = self.pipeline
        started = time.monotonic()
        quarantine_positions = self.quarantine.positions(left)
        # The quarantine table keeps only rows at or after its own position (heals a crash
        # between the quarantine commit and the main commit).
        floors = {p: max(r.start, quarantine_positions[p] or 0) for p, r in left.items()}
        tasks, budget = split_tasks({p: r for p, r in left.items() if r.count}, pipeline.limits, self.bytes_per_offset)
        results = self._write_files(tasks, budget, floors) if tasks else []
        self._learn_sizes(results)
        ends, kept, dropped = covered_prefix(results, {p: r.start for p, r in left.items()})
        self._discard([f for r in dropped for f in r.files])
        files = [f for r in kept for f in r.files]
        main_files = [f for f in files if f.table == "main"]
        quarantine_files = [f for f in files if f.table == "quarantine"]
        read = {p: (left[p].start, ends[p]) for p in left}
        options = pipeline.sink.storage_options
        validate_files(pipeline.sink.table_uri, main_files, pipeline.table_schema(), pipeline.sink.partition_by, read, options)
        validate_files(pipeline.sink.quarantine_uri, quarantine_files, QUARANTINE_SCHEMA, (), read, options)
        written = sum(f.num_records for f in main_files)
        quarantined = sum(r.quarantined for r in kept)
        record = CommitRecord(
            pipeline=pipeline.name, run_id=self.run_id, batch_seq=batch.seq, until=self.plan.until,
            ranges=nested({p: [s, e] for p, (s, e) in read.items()}),
            records={"written": written, "quarantined": quarantined, "filtered": sum(r.records for r in kept) - written - quarantined},
            gaps=[g for g in batch.gaps if positions.get(KafkaPartition(g.topic, g.partition)) == g.start],
            topic_ids={t: self.plan.identities[t].topic_id for t in sorted({p.topic for p in read})},
            cluster_id=next(iter(self.plan.identities.values())).cluster_id if self.plan.identities else None,
            bytes_read=sum(r.bytes_read for r in kept),
            log_end=nested({p: self.plan.bounds[p].latest for p in read if p in self.plan.bounds}),
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        new_positions = {p: e for p, (_, e) in read.items()}
        if quarantine_files:
            touched = {KafkaPartition.parse(key) for f in quarantine_files for key in f.offsets}
            outcome = self._commit(self.quarantine, quarantine_files, {p: quarantine_positions[p] for p in touched},
                                   {p: new_positions[p] for p in touched}, partitions, record)
            if outcome.version is not None:
                report.quarantine_versions.append(outcome.version)
            # The main commit moves positions over quarantined records too: only once the quarantine
            # table holds its part of the range (ours, or another run's commit of the same records).
            held = self.quarantine.positions(touched)
            short = {p: held[p] for p in touched if held[p] is None or held[p] < new_positions[p]}
            if short:
                log.warning("%s: the quarantine table holds %s, not the ends %s this part reached; its main "
                            "commit waits, the batch goes round from the positions as they are", self.where,
                            by_text(short), by_text({p: new_positions[p] for p in short}))
                delete_files(self.main.table_uri, main_files, self.main.storage_options)  # never offered to a commit
                return
        outcome = self._commit(self.main, main_files, {p: positions[p] for p in left}, new_positions, partitions, record)
        if outcome.status == "committed":
            report.status = "committed"
            report.written += written
            report.quarantined += quarantined
            report.versions.append(outcome.version)
            if pipeline.commit_consumer_group:
                held = self.main.positions(partitions)
                mirror_positions(pipeline, {p: v for p, v in held.items() if v is not None}, outcome.version)
        log.info("%s: batch %d %s %s (%d written, %d quarantined)", pipeline.name, batch.seq, outcome.status,
                 ", ".join(f"{p} [{s}, {e})" for p, (s, e) in sorted(read.items())), written, quarantined)
        ours = outcome.status == "committed"
        self.progress.advance(batch.seq, sum(e - s for s, e in read.values()),
                              written + quarantined if ours else 0, record.bytes_read if ours else 0)

    def _commit(self, ledger: Ledger, files, expected, new_positions, partitions, record) -> CommitOutcome:
        try:
            outcome = commit(ledger, files, expected, new_positions, partitions, record)
        except CommitConflict as conflict:
            if not conflict.evidence.get("attempted"):  # refused before any commit attempt: the files are ours alone
                delete_files(ledger.table_uri, files, ledger.storage_options)
            # The batch loop re-reads the positions and goes on from wherever they are now.
            log.warning("%s: %s; continuing from the new positions", self.pipeline.name, conflict)
            return CommitOutcome("conflict", None)
        if outcome.status == "already_committed":
            log.warning("%s: %s already holds this range (another run committed it); dropping our files",
                        self.pipeline.name, ledger.table_uri)
            delete_files(ledger.table_uri, files, ledger.storage_options)
        elif outcome.status == "lost_race":
            # After a commit attempt the files are left alone; vacuum(full=True) removes them.
            log.warning("%s: %s: a concurrent run committed this range first", self.pipeline.name, ledger.table_uri)
        return outcome

    def _discard(self, files) -> None:
        pipeline = self.pipeline
        for table_name, uri in (("main", pipeline.sink.table_uri), ("quarantine", pipeline.sink.quarantine_uri)):
            delete_files(uri, [f for f in files if f.table == table_name], pipeline.sink.storage_options)

    def _learn_sizes(self, results: list[RangeResult]) -> None:
        for result in results:
            if result.reached > result.start and result.bytes_read:
                self.bytes_per_offset[result.key] = result.bytes_read / (result.reached - result.start)

    def _write_files(self, tasks: list[OffsetRange], budget: int, floors: dict[KafkaPartition, int]) -> list[RangeResult]:
        """One Spark job: each task reads its ranges (each up to ``budget`` bytes), decodes them and
        writes Parquet files; the driver gets back one manifest row per range."""
        from .source import INGEST_NAME  # imports pyspark: only once there is work to do

        pipeline = self.pipeline
        groups = group_tasks(tasks, self.spark.sparkContext.defaultParallelism, pipeline.limits.max_records_per_partition)
        spec = TaskSpec(
            format_type=pipeline.format.type, schema_ddl=pipeline.format.ddl, table_uri=pipeline.sink.table_uri,
            quarantine_uri=pipeline.sink.quarantine_uri, partition_by=pipeline.sink.partition_by,
            quarantine_floors=by_text(floors), storage_options=dict(pipeline.sink.storage_options),
        )
        reader = (
            self.spark.read.format(INGEST_NAME)
            .option("pipeline", pipeline.name)
            .option("tasks", json.dumps([[[t.topic, t.partition, t.start, t.end] for t in group] for group in groups]))
            .option("maxBytesPerTask", str(budget))
            .option("stallTimeoutMs", str(int(pipeline.source.stall_timeout_seconds * 1000)))
            .option("sink", spec.to_json())
        )
        for key, value in consumer_config(pipeline).items():
            reader = reader.option(f"kafka.{key}", value)
        for key, value in pipeline.sink.storage_options.items():
            reader = reader.option(f"storage.{key}", value)
        try:
            rows = reader.load().collect()
        except Exception as exc:  # a task's error, or its Python worker died (a crash names no offsets)
            raise task_failure(exc, pipeline.name, groups) from exc
        return [RangeResult.from_json(row["range"]) for row in rows]


def task_failure(exc: BaseException, pipeline: str, groups: list[list[OffsetRange]]) -> TaskFailed:
    """A failed Spark job as one line naming the ranges of the task that failed (Spark names its
    index, which is the group's: one input partition per group), else of every task."""
    found = re.search(r"Task (\d+) in stage [\d.]+ failed", str(exc))
    failed = [groups[int(found.group(1))]] if found and int(found.group(1)) < len(groups) else groups
    ranges = [r for group in failed for r in group]
    return TaskFailed(f"pipeline {pipeline}: the Spark task reading {', '.join(map(str, ranges))} failed: {root_cause(exc)}",
                      ranges=[str(r) for r in ranges])


def check_plan(pipeline: Pipeline, plan: Plan) -> None:
    """A handed plan must be this pipeline's, for its table, and each topic must still be the one
    it was planned on (a recreated topic restarts its offsets)."""
    where = f"pipeline {pipeline.name}"
    mismatches = [
        (what, planned, configured) for what, planned, configured in (
            ("pipeline", plan.pipeline, pipeline.name),
            ("table", table_location(plan.table_uri), table_location(pipeline.sink.table_uri)),
        ) if planned != configured
    ]
    foreign = [t for t in plan.topics if not pipeline.source.subscribes(t)]
    if foreign:
        mismatches.append(("topic", foreign[0], pipeline.source.describe_subscription()))
    if mismatches:
        what, planned, configured = mismatches[0]
        raise StalePlan(f"{where}: the plan is for {what} {planned}, the pipeline's is {configured}",
                        planned=planned, configured=configured)
    identities = kafka.describe_source(kafka.admin_client(pipeline), pipeline).identities
    for topic, planned in sorted(plan.identities.items()):
        now = identities.get(topic)
        if now is None or (planned.topic_id and now.topic_id and planned.topic_id != now.topic_id) or (
                planned.cluster_id and now.cluster_id and planned.cluster_id != now.cluster_id):
            raise TopicChanged(
                f"{where}: topic {topic}: the plan was made for topic ID {planned.topic_id} on cluster "
                f"{planned.cluster_id}, the broker now has "
                + (f"topic ID {now.topic_id} on cluster {now.cluster_id}" if now else "no such topic for the pipeline")
                + "; nothing was read",
                topic=topic, planned_topic_id=planned.topic_id, topic_id=now.topic_id if now else None,
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
    if plan is None:
        plan = plan_run(pipeline, until)
    else:
        check_plan(pipeline, plan)
    report = RunReport(pipeline.name, run_id, plan)
    if spark_factory is None:
        from .spark import spark_session as spark_factory
    state = _Run(pipeline, plan, run_id, spark_factory)
    pending = [batch for batch in plan.batches if not state.holds(batch)]
    if not pending:
        report.batches = [BatchReport(b.seq, _ranges(b)) for b in plan.batches]
        report.seconds = time.monotonic() - started
        return report
    log.info("%s", describe(plan))
    ensure_tables(pipeline)
    state.progress = Progress(pipeline.name, len(plan.batches), state.offsets_left(pending))
    for batch in plan.batches:
        report.batches.append(state.ingest(batch))
    report.seconds = time.monotonic() - started
    return report
