"""One run end to end: plan -> no-op, or per batch part a Spark job (jobs.py) -> its commits (partcommit.py).

A batch runs from the table's *current* positions to its planned ends, so a retried, rerun or
partly committed plan does exactly the part the table does not hold yet, and a plan the table
already holds is a no-op that never starts Spark. Byte budgets may cut a batch short: the part
read is committed, and the rest of the batch follows in the next commit of the same batch_seq.
So may a record whose writer schema is ahead of the reader: the run follows that writer (the
table evolved for it) or, when the table cannot take it, refuses it (its records quarantined), and
the batch goes on; a record still ahead of the reader changed for it fails the run (ReaderBehind)
instead of going round. Each run starts from the subjects' latest schemas: a writer it follows
(an old producer after the latest version dropped a field) costs every run that meets it one
more part. An empty plan returns before pyspark is even imported.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from . import faults, kafka
from .config import OffsetBound, Pipeline
from .coordinates import KafkaPartition, by_text
from .errors import CommitConflict, StalePlan, TopicChanged
from .group_mirror import mirror_positions
from .jobs import ingest_job, shaped_job
from .ledger import Ledger
from .partcommit import Part, Written, commit_part
from .planner import LATEST, Batch, OffsetRange, Plan, describe, group_tasks, plan_run, split_tasks
from .profile import RUN_PHASES, Stopwatch, one_line
from .progress import Progress
from .recordformat import FormatError, ReaderBehind, follow, refuse, registries, resolve
from .recordspec import RecordSpec
from .schema import SchemaError, check_partition_by
from .spark import slots
from .storage import table_location
from .tasks import AheadRecord, RangeResult, TaskSpec
from .transform import VERDICT_PREFIX, TransformRefused

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
    profile: dict[str, int] = field(default_factory=dict)  # {phase: ms} (profile.py)

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
    """The state of one run: the pipeline's two ledgers, the Spark session once needed, how its
    records are decoded and shaped and the table's schema (resolved once there is work), and what
    this run has learned of its partitions' record sizes, and where its time went."""

    def __init__(self, pipeline: Pipeline, plan: Plan, run_id: str, spark_factory: Callable[[], object],
                 watch: Stopwatch):
        self.pipeline, self.plan, self.run_id, self.watch = pipeline, plan, run_id, watch
        self.run_phases_recorded = False  # in the record of the run's first commit
        options = pipeline.sink.storage_options
        self.main = Ledger(pipeline.sink.table_uri, pipeline.name, options)
        self.quarantine = Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)
        self.where = f"pipeline {pipeline.name}"
        self._spark_factory, self._spark = spark_factory, None
        self.bytes_per_offset: dict[KafkaPartition, float] = {}
        self.progress: Progress | None = None
        self.records = self.table_schema = self.registries = None

    @property
    def spark(self):
        if self._spark is None:
            with self.watch.timing("spark_start"):
                self._spark = self._spark_factory()
        return self._spark

    @cached_property
    def task_slots(self) -> int:
        return slots(self.spark)  # asked once: on Spark Connect it is a call to the server

    def prepare(self, ahead: AheadRecord | None = None) -> None:
        """How records are decoded (the registry asked once), what a transform makes of them
        (checked by Spark before a record is read), and the table made ready for it. With
        ``ahead``, a record whose writer schema the reader lacks: the reader follows that writer
        when the table can take the result (recordformat.follow), else the writer is refused, its
        records errors with the reason, and the table stays as it is."""
        started_spark = self.watch.seconds["spark_start"]
        with self.watch.timing("prepare"):
            self._prepare(ahead)
        # Spark starts here only for a transform's analysis: counted as its start, not as preparing.
        self.watch.seconds["prepare"] -= self.watch.seconds["spark_start"] - started_spark

    def _prepare(self, ahead: AheadRecord | None) -> None:
        from .evolution import SchemaChangeRefused

        if ahead is None:
            self.registries = registries(self.pipeline)
            self._take(resolve(self.pipeline, list(self.plan.topics)))
            return
        try:
            self._take(follow(self.pipeline, self.records, ahead.role, ahead.schema_id))
        except (FormatError, SchemaError, SchemaChangeRefused, TransformRefused) as exc:
            # Quarantined, not a failed run: every later run would fail on the same record.
            reason = (f"writer schema {ahead.schema_id} cannot be stored in the table: "
                      f"{exc.evidence['problem'] if isinstance(exc, SchemaChangeRefused) else exc}")
            log.warning("%s: %s/%d offset %d: %s; its records are quarantined", self.where, ahead.topic,
                        ahead.partition, ahead.offset, reason)
            self.records = refuse(self.records, ahead.role, ahead.schema_id, reason)

    def _take(self, records: RecordSpec) -> None:
        """Decodes records by ``records`` from now on, the table made ready for what they become;
        raises (leaving the run's records and table schema as they were) when it cannot be."""
        from .tables import ensure_tables

        schema = table_schema(self.pipeline, records, self.registries, lambda: self.spark)
        self.table_schema = ensure_tables(self.pipeline, schema)
        self.records = records

    def _shape(self, records):
        from .transform import shape

        return shape(self.spark, records, self.pipeline)

    def _spec(self, floors: dict[KafkaPartition, int], table_schema) -> TaskSpec:
        return task_spec(self.pipeline, self.records, table_schema, floors, self.registries)

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
        followed: AheadRecord | None = None  # the record the reader last changed for
        while True:
            positions = self.main.positions(batch.expected_positions)
            left = batch.remaining(positions, self.where)
            if not left:
                return report
            quarantine_before = self.quarantine.positions(left)
            ahead = self._ingest_part(batch, positions, left, quarantine_before, report)
            if ahead is not None:
                # A changed reader is progress (the part goes round with it), unless the record it
                # changed for stops the part again: then it would go round forever.
                if ahead == followed:
                    raise ReaderBehind(
                        f"{self.where}: topic {ahead.topic} partition {ahead.partition} offset {ahead.offset}: the "
                        f"record's {ahead.role} writer schema {ahead.schema_id} is still ahead of the reader the run "
                        f"changed for it; nothing from that offset on was read", topic=ahead.topic,
                        partition=ahead.partition, offset=ahead.offset, role=ahead.role, schema_id=ahead.schema_id)
                self.prepare(ahead)
                followed = ahead
                continue
            # A part that lost a race moves the other run's positions; one that moves nothing at all
            # would go round forever.
            if (self.main.positions(batch.expected_positions) == positions
                    and self.quarantine.positions(left) == quarantine_before):
                raise CommitConflict(f"{self.where}: batch {batch.seq} made no progress from {by_text(positions)}",
                                     positions=by_text(positions))

    def _ingest_part(self, batch: Batch, positions, left: dict[KafkaPartition, OffsetRange],
                     quarantine_positions, report: BatchReport) -> AheadRecord | None:
        """Reads what is left of the batch (up to the byte budgets) and commits what was read; returns
        the record a range stopped at because its writer schema is ahead of the reader, if any."""
        pipeline, plan = self.pipeline, self.plan
        # The quarantine table keeps only rows at or after its own position (heals a crash
        # between the quarantine commit and the main commit).
        floors = {p: max(r.start, quarantine_positions[p] or 0) for p, r in left.items()}
        spec = self._spec(floors, self.table_schema)
        # Through Spark, a partition's part is one range: files of its rows may mix ranges, so no
        # range of it may be dropped after a cut one.
        limits = (pipeline.limits.model_copy(update={"max_records_per_partition": 1 << 62})
                  if pipeline.shapes_in_spark else pipeline.limits)
        tasks, budget = split_tasks({p: r for p, r in left.items() if r.count}, limits, self.bytes_per_offset)
        # Spark starts here (task_slots), before the part's record takes the run's phases.
        groups = group_tasks(tasks, self.task_slots, pipeline.limits.max_records_per_partition) if tasks else []
        self.progress.begin()
        part = Part(
            pipeline=pipeline.name, run_id=self.run_id, batch_seq=batch.seq, until=plan.until,
            table_uri=pipeline.sink.table_uri, quarantine_uri=pipeline.sink.quarantine_uri,
            partition_by=pipeline.sink.partition_by, starts={p: r.start for p, r in left.items()},
            expected={p: positions[p] for p in left}, quarantine_expected=dict(quarantine_positions),
            partitions=tuple(sorted(plan.bounds)), gaps=batch.gaps,
            topic_ids={t: i.topic_id for t, i in plan.identities.items()},
            cluster_id=next(iter(plan.identities.values())).cluster_id if plan.identities else None,
            log_end={p: plan.bounds[p].latest for p in left if p in plan.bounds},
            profile={} if self.run_phases_recorded else self.watch.ms(RUN_PHASES),
            may_filter=pipeline.transform is not None,
        )
        if pipeline.shapes_in_spark and tasks:
            outcome = shaped_job(self.spark, pipeline, spec, groups, budget, part, self._shape)
        else:
            results = ingest_job(self.spark, pipeline, spec, groups, budget) if tasks else []
            self._learn_sizes(results)
            outcome = commit_part(part, results, Written(), self.table_schema, pipeline.sink.storage_options,
                                  (self.main, self.quarantine))
        self.watch.add_ms(outcome.profile)
        if outcome.quarantine_version is not None:
            report.quarantine_versions.append(outcome.quarantine_version)
        ours = outcome.status == "committed"
        if ours:
            self.run_phases_recorded = True
            report.status = "committed"
            report.written += outcome.records["written"]
            report.quarantined += outcome.records["quarantined"]
            report.versions.append(outcome.version)
            if pipeline.commit_consumer_group:
                held = self.main.positions(part.partitions)
                with self.watch.timing("mirror"):
                    mirror_positions(pipeline, {p: v for p, v in held.items() if v is not None}, outcome.version)
                faults.reach("mirrored")
        self.progress.advance(batch.seq, sum(e - s for s, e in outcome.read.values()),
                              outcome.records.get("written", 0) + outcome.records.get("quarantined", 0) if ours else 0,
                              outcome.bytes_read if ours else 0)
        if outcome.schema_ahead is None:
            return None
        ahead = AheadRecord.parse(outcome.schema_ahead)
        log.info("%s: topic %s partition %d offset %d: the record's %s writer schema %d has what the reader lacks: "
                 "the reader follows it, or the writer is refused, before the batch goes on", self.where, ahead.topic,
                 ahead.partition, ahead.offset, ahead.role, ahead.schema_id)
        return ahead

    def _learn_sizes(self, results: list[RangeResult]) -> None:
        for result in results:
            if result.reached > result.start and result.bytes_read:
                self.bytes_per_offset[result.key] = result.bytes_read / (result.reached - result.start)


def table_schema(pipeline: Pipeline, records: RecordSpec, registries, spark_factory: Callable[[], object]):
    """The table's schema for records decoded by ``records``: theirs, or what the transform makes of
    them, as Spark's analysis of it says before a record is read (the session from
    ``spark_factory``, asked only for a pipeline that shapes records in Spark); its partition
    columns checked. TransformRefused names what does not resolve or fit."""
    schema = records.schema(*registries)
    if pipeline.shapes_in_spark:
        from .evolution import arrow_schema
        from .source import RECORDS_NAME
        from .transform import shape

        spark = spark_factory()
        probe = _probe_options(task_spec(pipeline, records, schema, {}, registries))
        shaped = shape(spark, spark.read.format(RECORDS_NAME).options(**probe).load(), pipeline)
        schema = arrow_schema(shaped.drop(*[c for c in shaped.columns if c.startswith(VERDICT_PREFIX)]).schema)
    try:
        check_partition_by(schema, pipeline.sink.partition_by)
    except SchemaError as exc:
        raise TransformRefused(f"pipeline {pipeline.name}: sink.partition_by: {exc}") from None
    return schema


def task_spec(pipeline: Pipeline, records: RecordSpec, table_schema, floors: dict[KafkaPartition, int],
              registries) -> TaskSpec:
    """What every task of the pipeline's records needs: how to decode them, where to write, the
    quarantine table's ``floors``."""
    sink = pipeline.sink
    return TaskSpec(records, table_schema, sink.table_uri, sink.quarantine_uri, sink.partition_by, by_text(floors),
                    dict(sink.storage_options), *registries)


def _probe_options(spec: TaskSpec) -> dict[str, str]:
    """Options of a records DataFrame that reads nothing: what Spark's analysis of a transform needs."""
    options = {"tasks": "[]", "maxBytesPerTask": "1", "spec": spec.to_json(), "staging": "probe"}
    for prefix, settings in (("registry.", spec.value_registry or {}), ("key.registry.", spec.key_registry or {})):
        options.update({f"{prefix}{k}": v for k, v in settings.items()})
    return options


def new_run_id() -> str:
    return f"oncemore-{uuid.uuid4().hex[:12]}"


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
    run_id = run_id or new_run_id()
    watch = Stopwatch()
    with watch.timing("plan"):
        if plan is None:
            plan = plan_run(pipeline, until)
        else:
            check_plan(pipeline, plan)
    report = RunReport(pipeline.name, run_id, plan)
    if spark_factory is None:
        from .spark import spark_session as spark_factory
    state = _Run(pipeline, plan, run_id, spark_factory, watch)
    with watch.timing("plan"):
        pending = [batch for batch in plan.batches if not state.holds(batch)]
    if pending:
        log.info("%s", describe(plan))
        faults.reach("planned")
        state.prepare()
        state.progress = Progress(pipeline.name, len(plan.batches), state.offsets_left(pending))
        for batch in plan.batches:
            report.batches.append(state.ingest(batch))
    else:
        report.batches = [BatchReport(b.seq, _ranges(b)) for b in plan.batches]
    report.seconds, report.profile = time.monotonic() - started, watch.ms()
    log.info("%s: profile: %s", pipeline.name, one_line(report.profile))
    return report
