"""Planning: which offsets a run ingests, as batches of per-partition ranges. No Spark.

``plan()`` is a pure function of the ledger positions and the resolved bounds, so the same
ledger and the same bound give the same plan; ``plan_run()`` gathers those inputs from Delta and
Kafka after checking that the positions still refer to this topic on this cluster.
``Batch.remaining()`` and ``split_tasks()`` turn a batch into the work left from the table's
current positions, which is what makes a retried or partly committed plan safe to run again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping

from confluent_kafka.admin import AdminClient

from oncemore.config.model import Limits, Pipeline
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import KafkaPartition, OffsetRange, by_text, from_text
from oncemore.core.errors import DataLoss, PlanError, StalePlan
from oncemore.kafka import clients
from oncemore.kafka.clients import PartitionBounds, TopicIdentity
from oncemore.plan import bounds as bounds_
from oncemore.plan.commitinfo import Gap
from oncemore.plan.tables import Ledgers, plan_table_uri

LATEST = OffsetBound(kind="latest")
# Share of a byte budget planned from record sizes already seen: sizes vary, a cut task wastes work.
SIZE_MARGIN = 0.8


@dataclass(frozen=True)
class Batch:
    """One Delta commit's worth of ranges (more than one commit if byte limits cut it).

    ``expected_positions`` are the positions this batch builds on (None: no position yet).
    """

    seq: int
    ranges: tuple[OffsetRange, ...]
    expected_positions: Mapping[KafkaPartition, int | None]
    gaps: tuple[Gap, ...] = ()

    @property
    def offset_count(self) -> int:
        return sum(r.count for r in self.ranges)

    def remaining(self, positions: Mapping[KafkaPartition, int | None], where: str) -> dict[KafkaPartition, OffsetRange]:
        """The part of this batch the table does not hold yet, given its current ``positions``:
        per partition, from the current position to the batch's end (the whole range, gap
        included, while the position is still the expected one). Empty when the table already
        holds the whole batch; a position outside [expected, end] means the plan is stale."""
        left: dict[KafkaPartition, OffsetRange] = {}
        for r in self.ranges:
            current, expected = positions.get(r.key), self.expected_positions[r.key]
            if current == expected:
                left[r.key] = r
            elif current is not None and current >= r.end:
                continue
            elif current is not None and r.start <= current < r.end and (expected is None or current > expected):
                left[r.key] = OffsetRange(r.topic, r.partition, current, r.end)
            else:
                raise StalePlan(
                    f"{where}: {r.key}: the plan's batch {self.seq} builds on position {expected} and ends at "
                    f"{r.end}, but the table holds position {current}: the plan is stale, plan again",
                    topic=r.topic, partition=r.partition, expected=expected, found=current, end=r.end,
                )
        return left


@dataclass(frozen=True)
class Plan:
    pipeline: str
    topics: tuple[str, ...]
    table_uri: str
    until: str
    batches: tuple[Batch, ...]
    identities: Mapping[str, TopicIdentity] = field(default_factory=dict)
    positions: Mapping[KafkaPartition, int | None] = field(default_factory=dict)
    bounds: Mapping[KafkaPartition, PartitionBounds] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.batches

    @property
    def offset_count(self) -> int:
        return sum(b.offset_count for b in self.batches)

    def pending(self, positions: Mapping[KafkaPartition, int | None]) -> tuple[Batch, ...]:
        """The batches the table does not hold whole at ``positions`` (a retry or rerun of finished
        work holds them all)."""
        return tuple(b for b in self.batches
                     if not all(positions.get(r.key) is not None and positions[r.key] >= r.end for r in b.ranges))

    def offsets_left(self, positions: Mapping[KafkaPartition, int | None]) -> int:
        """Offsets of the plan the table does not hold at ``positions``."""
        return sum(max(r.end - max(r.start, positions.get(r.key) or 0), 0) for b in self.batches for r in b.ranges)

    def ends(self) -> dict[KafkaPartition, int]:
        """Where the plan leaves each partition it touches."""
        ends: dict[KafkaPartition, int] = {}
        for batch in self.batches:
            for r in batch.ranges:
                ends[r.key] = max(ends.get(r.key, r.end), r.end)
        return ends

    def to_json(self) -> str:
        return json.dumps({
            "pipeline": self.pipeline, "topics": list(self.topics), "table_uri": self.table_uri, "until": self.until,
            "batches": [{"seq": b.seq, "ranges": [asdict(r) for r in b.ranges],
                         "expected_positions": by_text(b.expected_positions), "gaps": [asdict(g) for g in b.gaps]}
                        for b in self.batches],
            "identities": {t: asdict(i) for t, i in sorted(self.identities.items())},
            "positions": by_text(self.positions), "bounds": {k: asdict(v) for k, v in by_text(self.bounds).items()},
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        return cls(
            pipeline=data["pipeline"],
            topics=tuple(data["topics"]),
            table_uri=data["table_uri"],
            until=data["until"],
            batches=tuple(
                Batch(
                    seq=b["seq"],
                    ranges=tuple(OffsetRange(**r) for r in b["ranges"]),
                    expected_positions=from_text(b["expected_positions"]),
                    gaps=tuple(Gap(**g) for g in b["gaps"]),
                )
                for b in data["batches"]
            ),
            identities={t: TopicIdentity(**i) for t, i in data["identities"].items()},
            positions=from_text(data["positions"]),
            bounds={k: PartitionBounds(**v) for k, v in from_text(data["bounds"]).items()},
        )


def plan(
    pipeline: Pipeline,
    positions: Mapping[KafkaPartition, int | None],
    bounds: Mapping[KafkaPartition, PartitionBounds],
    starts: Mapping[KafkaPartition, int],
    ends: Mapping[KafkaPartition, int | None],
    until: str = "latest",
    identities: Mapping[str, TopicIdentity] | None = None,
) -> Plan:
    """Plans ranges from each partition's position up to its resolved end.

    ``positions``: ledger positions (None: never committed); ``starts``: where never-committed
    partitions begin (``starting_offsets`` for a topic's first commit, earliest after it: such a
    partition was added to the topic later); ``ends``: resolved `until` offsets (None: leave the
    partition alone).
    """
    ranges: dict[KafkaPartition, OffsetRange] = {}
    gaps: dict[KafkaPartition, Gap] = {}
    # Until a topic's first commit, every partition of it is recorded with the first batch, so
    # afterwards "no position" can only mean a partition added to the topic later.
    new_topics = {p.topic for p in bounds} - {p.topic for p, v in positions.items() if v is not None}
    anchors: dict[str, list[KafkaPartition]] = {}
    for key in sorted(bounds):
        log = bounds[key]
        position = positions.get(key)
        start = position if position is not None else starts[key]
        where = f"pipeline {pipeline.name}: {key}"
        if start > log.latest:
            raise PlanError(
                f"{where}: starting offset {start} is beyond the log end {log.latest} (log start {log.earliest})",
                pipeline=pipeline.name, topic=key.topic, partition=key.partition, start=start, log_end=log.latest,
            )
        end = ends.get(key)
        end = start if end is None else min(end, log.latest)
        if end <= start:
            if key.topic in new_topics:
                anchors.setdefault(key.topic, []).append(key)
                ranges[key] = OffsetRange(key.topic, key.partition, start, start)
            continue
        if start < log.earliest:
            if pipeline.fail_on_data_loss:
                raise DataLoss(
                    f"{where}: offsets [{start}, {log.earliest}) are no longer in the log (log start "
                    f"{log.earliest}, {'position' if position is not None else 'starting offset'} {start}); "
                    "they were deleted before being ingested. Set fail_on_data_loss: false to skip them "
                    "(the gap is recorded in the commit).",
                    pipeline=pipeline.name, topic=key.topic, partition=key.partition, start=start, log_start=log.earliest,
                )
            skipped_to = min(log.earliest, end)
            gaps[key] = Gap(key.topic, key.partition, start, skipped_to)
            start = skipped_to
        ranges[key] = OffsetRange(key.topic, key.partition, start, end)
    if pipeline.source.starting_offsets.kind != "latest":
        # A new topic with nothing to read anywhere: the next run resolves the same starts again.
        # Only "latest" moves on, so it must be recorded now.
        for topic, keys in anchors.items():
            if all(ranges[k].count == 0 for k in ranges if k.topic == topic):
                for key in keys:
                    del ranges[key]

    anchors = {}
    if pipeline.routes is not None:
        # A routed pipeline's tables each record a partition before any record of it is read
        # (tables.py): a table without a position is then never one a crash left behind.
        anchors = {p: OffsetRange(r.topic, r.partition, r.start, r.start) for p, r in ranges.items()
                   if positions.get(p) is None and r.count}
    batches = _chunk(pipeline.limits.max_records_per_commit, ranges, positions, gaps, anchors)
    return Plan(
        pipeline=pipeline.name,
        topics=tuple(sorted({p.topic for p in bounds})),
        table_uri=plan_table_uri(pipeline),
        until=until,
        batches=tuple(batches),
        identities=dict(identities or {}),
        positions=dict(positions),
        bounds=dict(bounds),
    )


def _chunk(
    max_records: int,
    ranges: Mapping[KafkaPartition, OffsetRange],
    positions: Mapping[KafkaPartition, int | None],
    gaps: Mapping[KafkaPartition, Gap],
    anchors: Mapping[KafkaPartition, OffsetRange] | None = None,
) -> list[Batch]:
    """Splits ranges into batches of at most ``max_records`` offsets, sharing each batch fairly
    between partitions. Ranges with nothing to read (anchors, gap-only) ride in the first batch;
    a gap is recorded by the batch that moves its partition across it. ``anchors``: ranges with
    nothing to read that make a first batch of their own, before their partitions' records."""
    cursor = {p: r.start for p, r in ranges.items()}
    expected = {p: positions.get(p) for p in ranges}
    pending = [p for p, r in ranges.items() if r.count == 0]
    batches: list[Batch] = []
    if anchors:
        batches.append(Batch(seq=0, ranges=tuple(sorted(anchors.values())),
                             expected_positions={p: expected[p] for p in anchors}))
        expected.update({p: r.start for p, r in anchors.items()})
    while True:
        open_partitions = sorted((p for p in ranges if cursor[p] < ranges[p].end), key=lambda p: (ranges[p].end - cursor[p], p))
        if not open_partitions and not pending:
            return batches
        budget, taken = max_records, {}
        for i, key in enumerate(open_partitions):
            share = -(-budget // (len(open_partitions) - i))  # ceil: leftovers go to larger ranges
            take = min(ranges[key].end - cursor[key], share)
            taken[key] = take
            budget -= take
        batch_ranges = [OffsetRange(p.topic, p.partition, cursor[p], cursor[p] + n) for p, n in taken.items() if n > 0]
        batch_ranges += [OffsetRange(p.topic, p.partition, cursor[p], cursor[p]) for p in pending]
        batch_ranges.sort()
        batches.append(
            Batch(
                seq=len(batches),
                ranges=tuple(batch_ranges),
                expected_positions={r.key: expected[r.key] for r in batch_ranges},
                gaps=tuple(gaps[r.key] for r in batch_ranges if r.key in gaps and expected[r.key] == gaps[r.key].start),
            )
        )
        for r in batch_ranges:
            cursor[r.key] = expected[r.key] = r.end
        pending = []


def split_tasks(
    ranges: Mapping[KafkaPartition, OffsetRange], limits: Limits, bytes_per_offset: Mapping[KafkaPartition, float]
) -> tuple[list[OffsetRange], int]:
    """The ranges Spark tasks read for ``ranges``, and the byte budget of each.

    A partition's range is cut into task ranges of at most ``max_records_per_partition`` offsets.
    Where this run has already seen how large the partition's records are, a task range holds
    about SIZE_MARGIN of ``max_bytes_per_task`` and the partition no more than its share of
    ``max_bytes_per_commit`` (the rest waits for the next commit), so budgets rarely cut a task.
    Every task stops at the budget, ``min(max_bytes_per_task, max_bytes_per_commit / tasks)``: neither
    a task nor a commit exceeds its byte limit by more than one record a task, whatever the
    records' size (a task always reads at least one record, so a run always moves on).
    """
    tasks: list[OffsetRange] = []
    share = limits.max_bytes_per_commit / max(1, len(ranges))
    for key, r in sorted(ranges.items()):
        size, end = limits.max_records_per_partition, r.end
        seen = bytes_per_offset.get(key)
        if seen:
            size = min(size, max(1, int(SIZE_MARGIN * limits.max_bytes_per_task / seen)))
            end = min(end, r.start + max(1, int(SIZE_MARGIN * share / seen)))
        tasks += [OffsetRange(r.topic, r.partition, s, min(s + size, end)) for s in range(r.start, end, size)]
    budget = min(limits.max_bytes_per_task, limits.max_bytes_per_commit // max(1, len(tasks)))
    return tasks, max(1, budget)


def group_tasks(tasks: list[OffsetRange], slots: int, max_records: int) -> list[list[OffsetRange]]:
    """The task ranges packed into Spark tasks, each reading its ranges one after another.

    One Spark task per range costs a Python worker round trip and a Kafka connection each: with
    many partitions and few records a batch spent its time scheduling (64 one-record ranges took
    about 20 s a batch on 2 cores). Ranges are packed into about as many tasks as the cluster has
    slots, or as ``max_records`` offsets a task allow, whichever is more, balanced by offsets
    (largest first onto the lightest task). Memory stays per range: ranges are read in turn.
    """
    total = sum(t.count for t in tasks)
    count = min(len(tasks), max(1, slots, -(-total // max_records)))
    groups: list[list[OffsetRange]] = [[] for _ in range(count)]
    load = [0] * count
    for task in sorted(tasks, key=lambda t: (-t.count, t)):
        lightest = load.index(min(load))
        groups[lightest].append(task)
        load[lightest] += task.count
    return [sorted(group) for group in groups if group]


def plan_run(pipeline: Pipeline, until: OffsetBound = LATEST, admin: AdminClient | None = None) -> Plan:
    """Reads the ledger and the log, checks they still belong together, then plans; and checks
    that the principal may read the topics the plan reads (clients.check_readable)."""
    admin = admin or clients.admin_client(pipeline)
    state = clients.describe_source(admin, pipeline)
    log = clients.log_bounds(admin, pipeline, state.partitions)
    positions = Ledgers(pipeline).checked_positions(state.identities, log)
    starts = first_offsets(admin, pipeline, positions, log)
    range_starts = {p: positions[p] if positions[p] is not None else starts[p] for p in log}
    # Explicit `until` offsets leave unnamed partitions where they are.
    ends = bounds_.resolve(admin, pipeline, until, log, range_starts, default={p: None for p in log})
    planned = plan(pipeline, positions, log, starts, ends, until=until.describe(), identities=state.identities)
    # All asked so far needs DESCRIBE only: whether the principal may READ what is planned shows
    # only by fetching, here rather than in a Spark task after the table was created.
    clients.check_readable(pipeline, {r.key: log[r.key] for b in planned.batches for r in b.ranges if r.count})
    return planned


def first_offsets(admin: AdminClient, pipeline: Pipeline, positions: Mapping[KafkaPartition, int | None],
                  log: Mapping[KafkaPartition, PartitionBounds]) -> dict[KafkaPartition, int]:
    """Where each partition of ``log`` starts while it has no position: a topic's first commit at
    ``starting_offsets``; a partition added to a topic after its first commit at its beginning."""
    positioned = {p.topic for p, v in positions.items() if v is not None}
    earliest = {p: b.earliest for p, b in log.items()}
    new = {p: b for p, b in log.items() if p.topic not in positioned}
    starts = dict(earliest)
    if new:
        starts.update(bounds_.resolve(admin, pipeline, pipeline.source.starting_offsets.only({p.topic for p in new}),
                                      new, range_starts={p: None for p in new}, default=earliest))
    return starts


def describe(plan_: Plan) -> str:
    """Human-readable plan, one line per range."""
    lines = [f"plan for pipeline {plan_.pipeline} (topics {', '.join(plan_.topics)}, until {plan_.until}):"]
    if plan_.is_empty:
        lines.append("  nothing to ingest (no-op)")
    for batch in plan_.batches:
        lines.append(f"  batch {batch.seq}: {batch.offset_count} offsets")
        for r in batch.ranges:
            if r.count:
                lines.append(f"    {r}")
            else:
                lines.append(f"    {r.key}: nothing to read, position recorded at {r.end}")
        for g in batch.gaps:
            lines.append(f"    gap {g.topic}/{g.partition}: [{g.start}, {g.end}) no longer in the log, skipped")
    return "\n".join(lines)
