"""One run end to end, its stages in order: plan (or check a handed plan) -> no-op, or prepare
(prepare.py) -> per part of each batch, a Spark job (jobs.py) -> its commits (commit/part.py).

A batch runs from the table's *current* positions to its planned ends, so a retried, rerun or
partly committed plan does exactly the part the table does not hold yet, and a plan the table
already holds is a no-op that never starts Spark. Byte budgets may cut a batch short: the part
read is committed, and the rest of the batch follows in the next commit of the same batch_seq.
So may a record whose writer schema is ahead of the reader: the run follows that writer (the
table evolved for it) or, when the table cannot take it, refuses it (its records quarantined), and
the batch goes on; a record still ahead of the reader changed for it fails the run (ReaderBehind)
instead of going round. Each run starts from the subjects' latest schemas: a writer it follows
(an old producer after the latest version dropped a field) costs every run that meets it one
more part. An empty plan returns before pyspark is even imported. A part that quarantined more
than the pipeline's ``quarantine`` limit fails the run before its commits (commit/share.py), unless
the run accepts it (``accept_quarantine``): then it commits, and its record and the run's report
say so.

With ``sink.catalog``, the run ends by registering the tables (catalog/registration.py), a no-op
run too; a registration that fails makes the run fail after its commits, naming what it committed
and the catalog's error (DESIGN.md 8: it never holds data back); so does a consumer-group mirror
(``commit_consumer_group``) that failed to take a commit's positions.
"""

from __future__ import annotations

import logging
import time
import uuid
from functools import cached_property
from typing import Callable

from oncemore.catalog.registration import register
from oncemore.commit.groupmirror import GroupMirror
from oncemore.commit.inputs import AheadRecord, Part, RangeResult, RouteTable, UpsertSpec
from oncemore.commit.part import PartOutcome, Written, commit_part
from oncemore.commit.share import QuarantineLimit
from oncemore.config.model import Pipeline
from oncemore.config.values import OffsetBound
from oncemore.core import crashpoints
from oncemore.core.columns import QUARANTINE_TAG, key_columns
from oncemore.core.coordinates import KafkaPartition, by_text
from oncemore.core.errors import CatalogError, CommitConflict, MirrorError
from oncemore.core.stopwatch import RUN_PHASES, Stopwatch, one_line
from oncemore.decode.resolve import ReaderBehind
from oncemore.plan.handed import check_plan
from oncemore.plan.parts import PartPlan, next_part
from oncemore.plan.planner import LATEST, Batch, Plan, describe, group_tasks, plan_run, split_tasks
from oncemore.plan.tables import Ledgers, judging
from oncemore.run.jobs import ingest_job, shaped_job
from oncemore.run.prepare import Prepared, follow_writer, prepare
from oncemore.run.progress import Progress
from oncemore.run.runreport import BatchReport, RunReport
from oncemore.run.session import slots
from oncemore.shape.transform import shape

log = logging.getLogger("oncemore")


def new_run_id() -> str:
    return f"oncemore-{uuid.uuid4().hex[:12]}"


def run(
    pipeline: Pipeline,
    until: OffsetBound = LATEST,
    run_id: str | None = None,
    plan: Plan | None = None,
    spark_factory: Callable[[], object] | None = None,
    accept_quarantine: bool = False,
) -> RunReport:
    started = time.monotonic()
    run_id = run_id or new_run_id()
    watch = Stopwatch()
    with watch.timing("plan"):
        ledgers = Ledgers(pipeline)
        plan = plan_run(pipeline, until) if plan is None else check_plan(pipeline, plan, ledgers)
        positions = ledgers.positions(plan.ends()) if plan.batches else {}  # an empty plan reads no table
        pending = plan.pending(positions)
    report = RunReport(pipeline.name, run_id, plan)
    if pending:
        log.info("%s", describe(plan))
        crashpoints.reach("planned")
        if spark_factory is None:
            from oncemore.run.session import spark_session as spark_factory
        state = _Run(pipeline, plan, run_id, ledgers, spark_factory, watch, accept_quarantine)
        state.prepare(lambda: prepare(pipeline, list(plan.topics), lambda: state.spark))
        state.progress = Progress(pipeline.name, len(plan.batches), plan.offsets_left(positions))
        report.batches = [state.ingest(batch) for batch in plan.batches]
        unmirrored = state.mirror.failure if state.mirror is not None else None
    else:
        report.batches = [BatchReport(b.seq, _ranges(b)) for b in plan.batches]
        unmirrored = None
    unregistered = None
    if pipeline.sink.catalog is not None:
        with watch.timing("catalog"):
            unregistered = _register(pipeline)
    report.seconds, report.profile = time.monotonic() - started, watch.ms()
    log.info("%s: profile: %s", pipeline.name, one_line(report.profile))
    mirror = f"; and the consumer group is not mirrored: {unmirrored}; the next run mirrors it" if unmirrored else ""
    if unregistered is not None:
        raise CatalogError(f"{report.summary()}; but the tables are not registered: {unregistered}; the next run "
                           f"registers them{mirror}", **unregistered.evidence, run=report.summary())
    if unmirrored is not None:
        raise MirrorError(f"{report.summary()}; but the consumer group is not mirrored: {unmirrored}; the table "
                          "holds the positions, and the next run mirrors them", run=report.summary(),
                          profile=report.profile)
    return report


def _register(pipeline: Pipeline) -> CatalogError | None:
    """The tables registered in the pipeline's catalog after the commits (a no-op run too: it
    registers what an earlier run could not); what went wrong, raised only once the run's report
    is complete."""
    try:
        register(pipeline)
    except CatalogError as exc:
        return exc
    return None


def _ranges(batch: Batch) -> dict[KafkaPartition, tuple[int, int]]:
    return {r.key: (r.start, r.end) for r in batch.ranges}


class _Run:
    """The state of one run with work to do: the pipeline's tables' ledgers, the Spark session once
    needed, the run's preparation (prepare.py), what this run has learned of its partitions' record
    sizes, and where its time went."""

    def __init__(self, pipeline: Pipeline, plan: Plan, run_id: str, ledgers: Ledgers,
                 spark_factory: Callable[[], object], watch: Stopwatch, accept_quarantine: bool):
        self.pipeline, self.plan, self.run_id, self.ledgers, self.watch = pipeline, plan, run_id, ledgers, watch
        self.quarantine_limit = QuarantineLimit(pipeline.quarantine.max_fraction, pipeline.quarantine.min_quarantined,
                                                accept_quarantine)
        self.where = f"pipeline {pipeline.name}"
        self.run_phases_recorded = False  # in the record of the run's first commit
        self._spark_factory, self._spark = spark_factory, None
        self.bytes_per_offset: dict[KafkaPartition, float] = {}
        self.progress: Progress | None = None
        self.prepared: Prepared | None = None
        self.mirror = GroupMirror(pipeline) if pipeline.commit_consumer_group else None

    @property
    def spark(self):
        if self._spark is None:
            with self.watch.timing("spark_start"):
                self._spark = self._spark_factory()
        return self._spark

    @cached_property
    def task_slots(self) -> int:
        return slots(self.spark)  # asked once: on Spark Connect it is a call to the server

    def prepare(self, preparation: Callable[[], Prepared]) -> None:
        """The run's preparation from now on, timed; Spark starts within it only for a transform's
        analysis, counted as its start, not as preparing."""
        started_spark = self.watch.seconds["spark_start"]
        with self.watch.timing("prepare"):
            self.prepared = preparation()
        self.watch.seconds["prepare"] -= self.watch.seconds["spark_start"] - started_spark

    def ingest(self, batch: Batch) -> BatchReport:
        """What is left of ``batch``, part after part, until the table holds it whole."""
        report = BatchReport(batch.seq, _ranges(batch))
        followed: AheadRecord | None = None  # the record the reader last changed for
        part = next_part(batch, self.ledgers, self.where)
        while part is not None:
            outcome = self._ingest_part(part)
            self._account(part, outcome, report)
            if outcome.schema_ahead is not None:
                ahead = AheadRecord.parse(outcome.schema_ahead)
                log.info("%s: topic %s partition %d offset %d: the record's %s writer schema %d has what the reader "
                         "lacks: the reader follows it, or the writer is refused, before the batch goes on",
                         self.where, ahead.topic, ahead.partition, ahead.offset, ahead.role, ahead.schema_id)
                # A changed reader is progress (the part goes round with it), unless the record it
                # changed for stops the part again: then it would go round forever.
                if ahead == followed:
                    raise ReaderBehind(
                        f"{self.where}: topic {ahead.topic} partition {ahead.partition} offset {ahead.offset}: the "
                        f"record's {ahead.role} writer schema {ahead.schema_id} is still ahead of the reader the run "
                        f"changed for it; nothing from that offset on was read", topic=ahead.topic,
                        partition=ahead.partition, offset=ahead.offset, role=ahead.role, schema_id=ahead.schema_id)
                self.prepare(lambda: follow_writer(self.pipeline, self.prepared, ahead, lambda: self.spark))
                followed = ahead
                part = next_part(batch, self.ledgers, self.where)
                continue
            following = next_part(batch, self.ledgers, self.where)
            if following == part:
                # Neither table's positions moved: a part that lost a race moves the other run's; one
                # that moves nothing at all would be planned again forever.
                raise CommitConflict(f"{self.where}: batch {batch.seq} made no progress from {by_text(part.positions)}",
                                     positions=by_text(part.positions))
            part = following
        return report

    def _ingest_part(self, part: PartPlan) -> PartOutcome:
        """Reads what is left of the batch (up to the byte budgets) on Spark and commits what was read."""
        pipeline = self.pipeline
        spec = self.prepared.task_spec(pipeline, {tag: part.floors(tag) for tag in part.held})
        # Through Spark, a partition's part is one range: files of its rows may mix ranges, so no
        # range of it may be dropped after a cut one.
        limits = (pipeline.limits.model_copy(update={"max_records_per_partition": 1 << 62})
                  if pipeline.shapes_in_spark else pipeline.limits)
        tasks, budget = split_tasks({p: r for p, r in part.left.items() if r.count}, limits, self.bytes_per_offset)
        # Spark starts here (task_slots), before the part's record takes the run's phases.
        groups = group_tasks(tasks, self.task_slots, pipeline.limits.max_records_per_partition) if tasks else []
        self.progress.begin()
        commits = self._commits(part)

        def commit(results, written, cluster=None) -> PartOutcome:
            return commit_part(commits, results, written, self.prepared.schemas(), pipeline.sink.storage_options,
                               self.ledgers.by_tag(), cluster=cluster)

        if pipeline.shapes_in_spark and tasks:
            return shaped_job(self.spark, pipeline, spec, groups, budget, commits,
                              lambda records: shape(self.spark, records, pipeline), commit)
        results = ingest_job(self.spark, pipeline, spec, groups, budget) if tasks else []
        self._learn_sizes(results)
        return commit(results, Written())

    def _commits(self, part: PartPlan) -> Part:
        """What the part's commits take: where it starts and what it builds on, from the plan."""
        plan, left, held = self.plan, part.left, part.held
        routes = tuple(RouteTable(t.tag, t.route, t.table_uri, t.partition_by, dict(held[t.tag]), part.floors(t.tag))
                       for t in self.pipeline.tables if t.route is not None)
        starts = {p: r.start for p, r in left.items()}
        found = self.ledgers.in_force() if routes else None
        return Part(
            pipeline=self.pipeline.name, run_id=self.run_id, batch_seq=part.batch.seq, until=plan.until,
            table_uri=self.pipeline.sink.table_uri, quarantine_uri=self.pipeline.sink.quarantine_uri,
            partition_by=self.pipeline.sink.partition_by, starts=starts,
            expected={} if routes else {p: part.positions[p] for p in left},
            quarantine_expected=dict(held[QUARANTINE_TAG]),
            partitions=tuple(sorted(plan.bounds)), gaps=part.batch.gaps,
            topic_ids={t: i.topic_id for t, i in plan.identities.items()},
            cluster_id=next(iter(plan.identities.values())).cluster_id if plan.identities else None,
            log_end={p: plan.bounds[p].latest for p in left if p in plan.bounds},
            quarantine_limit=self.quarantine_limit,
            profile={} if self.run_phases_recorded else self.watch.ms(RUN_PHASES),
            may_filter=self.pipeline.transform is not None,
            upsert=self._upsert(),
            routes=routes,
            routes_before=found,
            routes_in_force=self.ledgers.routes_record(plan.bounds, starts, found) if routes else None,
            judging=None if routes else judging(self.pipeline, self.pipeline.main),
        )

    def _upsert(self) -> UpsertSpec | None:
        upsert = self.pipeline.upsert
        if upsert is None:
            return None
        keys = tuple(key_columns(self.prepared.table_schema, upsert.keys))
        return UpsertSpec(keys, upsert.sequence_by is not None, self.pipeline.sink.tombstones_uri,
                          upsert.unavailable_value_placeholder, upsert.sequence_by, upsert.merge)

    def _account(self, part: PartPlan, outcome: PartOutcome, report: BatchReport) -> None:
        """The part's outcome in the batch's report, the consumer group and the run's progress."""
        self.watch.add_ms(outcome.profile)
        if outcome.quarantine_version is not None:
            report.quarantine_versions.append(outcome.quarantine_version)
        ours = outcome.status == "committed"
        # A quarantine commit of ours counts even when the main commit was not (another run's won).
        report.account(dict(outcome.read) if ours else {}, dict(outcome.added))
        if ours:
            self.run_phases_recorded = True
            report.status = "committed"
            report.written += outcome.records["written"]
            report.quarantined += outcome.records["quarantined"]
            report.unrouted += outcome.records.get("unrouted", 0)
            if self.pipeline.upsert is not None:
                report.events = report.events or {}
                for name, count in outcome.records.items():
                    if name not in ("written", "quarantined"):
                        report.events[name] = report.events.get(name, 0) + count
            report.quarantine_accepted = report.quarantine_accepted or outcome.quarantine_accepted
            if outcome.version is not None:
                report.versions.append(outcome.version)
            for tag, version in outcome.versions.items():
                report.table_versions[tag] = version
            if self.mirror is not None:
                held = self.ledgers.positions(self.plan.bounds)
                version = outcome.version if outcome.version is not None else ", ".join(
                    f"{tag} {v}" for tag, v in sorted(report.table_versions.items()))
                with self.watch.timing("mirror"):
                    self.mirror.mirror({p: v for p, v in held.items() if v is not None}, version)
                crashpoints.reach("mirrored")
        self.progress.advance(part.batch.seq, sum(e - s for s, e in outcome.read.values()),
                              outcome.records.get("written", 0) + outcome.records.get("quarantined", 0) if ours else 0,
                              outcome.bytes_read if ours else 0)

    def _learn_sizes(self, results: list[RangeResult]) -> None:
        for result in results:
            if result.reached > result.start and result.bytes_read:
                self.bytes_per_offset[result.key] = result.bytes_read / (result.reached - result.start)
