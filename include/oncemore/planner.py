"""Planning: which offsets a run ingests, as batches of per-partition ranges. No Spark.

``plan()`` is a pure function of the ledger positions and the log bounds, so the same ledger and
the same bound give the same plan; ``plan_run()`` gathers those inputs from Delta and Kafka.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping

from confluent_kafka.admin import AdminClient

from . import kafka
from .config import OffsetBound, Pipeline
from .kafka import PartitionBounds
from .ledger import Gap, Ledger

LATEST = OffsetBound(kind="latest")


class PlanError(RuntimeError):
    """The log and the ledger disagree in a way that must not be resolved silently."""


@dataclass(frozen=True)
class OffsetRange:
    """Offsets [start, end) of one partition; ``end`` is the position committed after it."""

    partition: int
    start: int
    end: int

    @property
    def count(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Batch:
    """One Delta commit's worth of ranges.

    ``expected_positions`` are the positions this batch builds on: the commit goes ahead only if
    the table still holds exactly these (None: no position yet).
    """

    seq: int
    ranges: tuple[OffsetRange, ...]
    expected_positions: Mapping[int, int | None]
    gaps: tuple[Gap, ...] = ()

    @property
    def offset_count(self) -> int:
        return sum(r.count for r in self.ranges)


@dataclass(frozen=True)
class Plan:
    pipeline: str
    topic: str
    until: str
    batches: tuple[Batch, ...]
    positions: Mapping[int, int | None] = field(default_factory=dict)
    bounds: Mapping[int, PartitionBounds] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.batches

    @property
    def offset_count(self) -> int:
        return sum(b.offset_count for b in self.batches)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        return cls(
            pipeline=data["pipeline"],
            topic=data["topic"],
            until=data["until"],
            batches=tuple(
                Batch(
                    seq=b["seq"],
                    ranges=tuple(OffsetRange(**r) for r in b["ranges"]),
                    expected_positions={int(p): v for p, v in b["expected_positions"].items()},
                    gaps=tuple(Gap(**g) for g in b["gaps"]),
                )
                for b in data["batches"]
            ),
            positions={int(p): v for p, v in data["positions"].items()},
            bounds={int(p): PartitionBounds(**v) for p, v in data["bounds"].items()},
        )


def plan(
    pipeline: Pipeline,
    positions: Mapping[int, int | None],
    bounds: Mapping[int, PartitionBounds],
    starts: Mapping[int, int],
    ends: Mapping[int, int | None],
    until: str = "latest",
) -> Plan:
    """Plans ranges from each partition's position up to its resolved end.

    ``positions``: ledger positions (None: never committed); ``starts``: where never-committed
    partitions begin (``starting_offsets`` before the first commit, earliest after it: such a
    partition was added to the topic later); ``ends``: resolved `until` offsets (None: leave the
    partition alone).
    """
    topic = pipeline.source.topic
    ranges: dict[int, OffsetRange] = {}
    gaps: list[Gap] = []
    # Until the first commit, every partition is recorded with the first batch, so afterwards "no
    # position" can only mean a partition added to the topic later.
    first_commit = all(positions.get(p) is None for p in bounds)
    unrecorded: list[int] = []
    for partition in sorted(bounds):
        log = bounds[partition]
        position = positions.get(partition)
        start = position if position is not None else starts[partition]
        where = f"pipeline {pipeline.name}: {topic}/{partition}"
        if start > log.latest:
            origin = "committed position" if position is not None else "starting offset"
            raise PlanError(
                f"{where}: {origin} {start} is beyond the log end {log.latest} (log start {log.earliest}); "
                "the topic was probably deleted and recreated. oncemore never resets positions by itself: "
                "ingest into a new table or fix the ledger deliberately."
            )
        end = ends.get(partition)
        end = start if end is None else min(end, log.latest)
        if end <= start:
            if first_commit:
                unrecorded.append(partition)
                ranges[partition] = OffsetRange(partition, start, start)
            continue
        if start < log.earliest:
            if pipeline.fail_on_data_loss:
                raise PlanError(
                    f"{where}: offsets [{start}, {log.earliest}) are no longer in the log (log start "
                    f"{log.earliest}, {'position' if position is not None else 'starting offset'} {start}); "
                    "they were deleted before being ingested. Set fail_on_data_loss: false to skip them "
                    "(the gap is recorded in the commit)."
                )
            skipped_to = min(log.earliest, end)
            gaps.append(Gap(topic, partition, start, skipped_to))
            start = skipped_to
        ranges[partition] = OffsetRange(partition, start, end)
    if len(unrecorded) == len(ranges) and pipeline.source.starting_offsets.kind != "latest":
        # Nothing to read anywhere: the next run resolves the same starts again. Only "latest"
        # moves on, so it must be recorded now.
        ranges = {}

    batches = _chunk(pipeline.limits.max_records_per_commit, ranges, positions, gaps)
    return Plan(
        pipeline=pipeline.name,
        topic=topic,
        until=until,
        batches=tuple(batches),
        positions=dict(positions),
        bounds=dict(bounds),
    )


def _chunk(
    max_records: int,
    ranges: Mapping[int, OffsetRange],
    positions: Mapping[int, int | None],
    gaps: list[Gap],
) -> list[Batch]:
    """Splits ranges into batches of at most ``max_records`` offsets, sharing each batch fairly
    between partitions. Ranges with nothing to read (anchors, gap-only) ride in the first batch."""
    cursor = {p: r.start for p, r in ranges.items()}
    expected = {p: positions.get(p) for p in ranges}
    pending = [p for p, r in ranges.items() if r.count == 0]
    batches: list[Batch] = []
    while True:
        open_partitions = sorted((p for p in ranges if cursor[p] < ranges[p].end), key=lambda p: ranges[p].end - cursor[p])
        if not open_partitions and not pending:
            return batches
        budget, taken = max_records, {}
        for i, partition in enumerate(open_partitions):
            share = -(-budget // (len(open_partitions) - i))  # ceil: leftovers go to larger ranges
            take = min(ranges[partition].end - cursor[partition], share)
            taken[partition] = take
            budget -= take
        batch_ranges = [OffsetRange(p, cursor[p], cursor[p] + n) for p, n in taken.items() if n > 0]
        batch_ranges += [OffsetRange(p, cursor[p], cursor[p]) for p in pending]
        batch_ranges.sort(key=lambda r: r.partition)
        seq = len(batches)
        batches.append(
            Batch(
                seq=seq,
                ranges=tuple(batch_ranges),
                expected_positions={r.partition: expected[r.partition] for r in batch_ranges},
                gaps=tuple(g for g in gaps if g.partition in {r.partition for r in batch_ranges}) if seq == 0 else (),
            )
        )
        for r in batch_ranges:
            cursor[r.partition] = expected[r.partition] = r.end
        pending = []


def resolve(
    admin: AdminClient,
    pipeline: Pipeline,
    bound: OffsetBound,
    bounds: Mapping[int, PartitionBounds],
    default: Mapping[int, int | None],
) -> dict[int, int | None]:
    """``bound`` as an offset per partition. ``default`` serves partitions the bound does not name."""
    if bound.kind == "earliest":
        return {p: b.earliest for p, b in bounds.items()}
    if bound.kind == "latest":
        return {p: b.latest for p, b in bounds.items()}
    if bound.kind == "timestamp":
        found = kafka.offsets_for_timestamp(admin, pipeline, bound.timestamp_ms, bounds)
        # No record that recent yet: everything up to the log end is older.
        return {p: (found[p] if found[p] is not None else b.latest) for p, b in bounds.items()}
    unknown = sorted(set(bound.offsets) - set(bounds))
    if unknown:
        raise PlanError(
            f"pipeline {pipeline.name}: topic {pipeline.source.topic} has no partition {unknown[0]} "
            f"(partitions: {', '.join(map(str, sorted(bounds)))})"
        )
    return {p: bound.offsets.get(p, default[p]) for p in bounds}


def plan_run(pipeline: Pipeline, until: OffsetBound = LATEST, admin: AdminClient | None = None) -> Plan:
    """Reads the ledger and the log, then plans. Cheap: one snapshot load and a few ListOffsets."""
    admin = admin or kafka.admin_client(pipeline)
    partitions = kafka.topic_partitions(admin, pipeline)
    bounds = kafka.log_bounds(admin, pipeline, partitions)
    positions = Ledger(pipeline.sink.table_uri, pipeline.name, pipeline.source.topic).committed_positions(partitions)
    earliest = {p: b.earliest for p, b in bounds.items()}
    if all(v is None for v in positions.values()):
        starts = resolve(admin, pipeline, pipeline.source.starting_offsets, bounds, default=earliest)
    else:
        starts = earliest  # partitions added after the first commit start at their beginning
    # Explicit `until` offsets leave unnamed partitions where they are.
    ends = resolve(admin, pipeline, until, bounds, default={p: None for p in bounds})
    return plan(pipeline, positions, bounds, starts, ends, until=until.describe())


def describe(plan_: Plan) -> str:
    """Human-readable plan, one line per range."""
    lines = [f"plan for pipeline {plan_.pipeline} (topic {plan_.topic}, until {plan_.until}):"]
    if plan_.is_empty:
        lines.append("  nothing to ingest (no-op)")
    for batch in plan_.batches:
        lines.append(f"  batch {batch.seq}: {batch.offset_count} offsets")
        for r in batch.ranges:
            if r.count:
                lines.append(f"    {plan_.topic}/{r.partition}: [{r.start}, {r.end})")
            else:
                lines.append(f"    {plan_.topic}/{r.partition}: nothing to read, position recorded at {r.end}")
        for g in batch.gaps:
            lines.append(f"    gap {g.topic}/{g.partition}: [{g.start}, {g.end}) no longer in the log, skipped")
    return "\n".join(lines)

