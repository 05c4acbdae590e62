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

from . import bounds as bounds_
from . import kafka
from .config import Limits, OffsetBound, Pipeline, known_pipeline_names
from .errors import DataLoss, PlanError, PositionsMissing, StalePlan, TableOwned, TopicChanged
from .kafka import PartitionBounds, TopicIdentity
from .ledger import NO_ID, RECENT_HISTORY, Gap, Ledger, fingerprint

LATEST = OffsetBound(kind="latest")
# Share of a byte budget planned from record sizes already seen: sizes vary, a cut task wastes work.
SIZE_MARGIN = 0.8


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
    """One Delta commit's worth of ranges (more than one commit if byte limits cut it).

    ``expected_positions`` are the positions this batch builds on (None: no position yet).
    """

    seq: int
    ranges: tuple[OffsetRange, ...]
    expected_positions: Mapping[int, int | None]
    gaps: tuple[Gap, ...] = ()

    @property
    def offset_count(self) -> int:
        return sum(r.count for r in self.ranges)

    def remaining(self, positions: Mapping[int, int | None], where: str) -> dict[int, OffsetRange]:
        """The part of this batch the table does not hold yet, given its current ``positions``:
        per partition, from the current position to the batch's end (the whole range, gap
        included, while the position is still the expected one). Empty when the table already
        holds the whole batch; a position outside [expected, end] means the plan is stale."""
        left: dict[int, OffsetRange] = {}
        for r in self.ranges:
            current, expected = positions.get(r.partition), self.expected_positions[r.partition]
            if current == expected:
                left[r.partition] = r
            elif current is not None and current >= r.end:
                continue
            elif current is not None and r.start <= current < r.end and (expected is None or current > expected):
                left[r.partition] = OffsetRange(r.partition, current, r.end)
            else:
                raise StalePlan(
                    f"{where}/{r.partition}: the plan's batch {self.seq} builds on position {expected} and ends at "
                    f"{r.end}, but the table holds position {current}: the plan is stale, plan again",
                    partition=r.partition, expected=expected, found=current, end=r.end,
                )
        return left


@dataclass(frozen=True)
class Plan:
    pipeline: str
    topic: str
    table_uri: str
    until: str
    batches: tuple[Batch, ...]
    identity: TopicIdentity = TopicIdentity(None, None)
    positions: Mapping[int, int | None] = field(default_factory=dict)
    bounds: Mapping[int, PartitionBounds] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.batches

    @property
    def offset_count(self) -> int:
        return sum(b.offset_count for b in self.batches)

    def ends(self) -> dict[int, int]:
        """Where the plan leaves each partition it touches."""
        ends: dict[int, int] = {}
        for batch in self.batches:
            for r in batch.ranges:
                ends[r.partition] = max(ends.get(r.partition, r.end), r.end)
        return ends

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        return cls(
            pipeline=data["pipeline"],
            topic=data["topic"],
            table_uri=data["table_uri"],
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
            identity=TopicIdentity(**data["identity"]),
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
    identity: TopicIdentity = TopicIdentity(None, None),
) -> Plan:
    """Plans ranges from each partition's position up to its resolved end.

    ``positions``: ledger positions (None: never committed); ``starts``: where never-committed
    partitions begin (``starting_offsets`` before the first commit, earliest after it: such a
    partition was added to the topic later); ``ends``: resolved `until` offsets (None: leave the
    partition alone).
    """
    topic = pipeline.source.topic
    ranges: dict[int, OffsetRange] = {}
    gaps: dict[int, Gap] = {}
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
            raise PlanError(
                f"{where}: starting offset {start} is beyond the log end {log.latest} (log start {log.earliest})",
                pipeline=pipeline.name, topic=topic, partition=partition, start=start, log_end=log.latest,
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
                raise DataLoss(
                    f"{where}: offsets [{start}, {log.earliest}) are no longer in the log (log start "
                    f"{log.earliest}, {'position' if position is not None else 'starting offset'} {start}); "
                    "they were deleted before being ingested. Set fail_on_data_loss: false to skip them "
                    "(the gap is recorded in the commit).",
                    pipeline=pipeline.name, topic=topic, partition=partition, start=start, log_start=log.earliest,
                )
            skipped_to = min(log.earliest, end)
            gaps[partition] = Gap(topic, partition, start, skipped_to)
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
        table_uri=pipeline.sink.table_uri,
        until=until,
        batches=tuple(batches),
        identity=identity,
        positions=dict(positions),
        bounds=dict(bounds),
    )


def _chunk(
    max_records: int,
    ranges: Mapping[int, OffsetRange],
    positions: Mapping[int, int | None],
    gaps: Mapping[int, Gap],
) -> list[Batch]:
    """Splits ranges into batches of at most ``max_records`` offsets, sharing each batch fairly
    between partitions. Ranges with nothing to read (anchors, gap-only) ride in the first batch;
    a gap is recorded by the batch that moves its partition across it."""
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
        batches.append(
            Batch(
                seq=len(batches),
                ranges=tuple(batch_ranges),
                expected_positions={r.partition: expected[r.partition] for r in batch_ranges},
                gaps=tuple(gaps[r.partition] for r in batch_ranges
                           if r.partition in gaps and expected[r.partition] == gaps[r.partition].start),
            )
        )
        for r in batch_ranges:
            cursor[r.partition] = expected[r.partition] = r.end
        pending = []


@dataclass(frozen=True)
class TaskRange:
    """Offsets [start, end) of one partition that one Spark task reads, up to the byte budget."""

    partition: int
    start: int
    end: int


def split_tasks(
    ranges: Mapping[int, OffsetRange], limits: Limits, bytes_per_offset: Mapping[int, float]
) -> tuple[list[TaskRange], int]:
    """Spark tasks for ``ranges`` and the byte budget of each.

    A partition's range is cut into tasks of at most ``max_records_per_partition`` offsets. Where
    this run has already seen how large the partition's records are, a task holds about
    SIZE_MARGIN of ``max_bytes_per_task`` and the partition no more than its share of
    ``max_bytes_per_commit`` (the rest waits for the next commit), so budgets rarely cut a task.
    Every task stops at the budget, ``min(max_bytes_per_task, max_bytes_per_commit / tasks)``: neither
    a task nor a commit exceeds its byte limit by more than one record a task, whatever the
    records' size (a task always reads at least one record, so a run always moves on).
    """
    tasks: list[TaskRange] = []
    share = limits.max_bytes_per_commit / max(1, len(ranges))
    for partition, r in sorted(ranges.items()):
        size, end = limits.max_records_per_partition, r.end
        seen = bytes_per_offset.get(partition)
        if seen:
            size = min(size, max(1, int(SIZE_MARGIN * limits.max_bytes_per_task / seen)))
            end = min(end, r.start + max(1, int(SIZE_MARGIN * share / seen)))
        tasks += [TaskRange(partition, s, min(s + size, end)) for s in range(r.start, end, size)]
    budget = min(limits.max_bytes_per_task, limits.max_bytes_per_commit // max(1, len(tasks)))
    return tasks, max(1, budget)


def group_tasks(tasks: list[TaskRange], slots: int, max_records: int) -> list[list[TaskRange]]:
    """The task ranges packed into Spark tasks, each reading its ranges one after another.

    One Spark task per range costs a Python worker round trip and a Kafka connection each: with
    many partitions and few records a batch spent its time scheduling (64 one-record ranges took
    about 20 s a batch on 2 cores). Ranges are packed into about as many tasks as the cluster has
    slots, or as ``max_records`` offsets a task allow, whichever is more, balanced by offsets
    (largest first onto the lightest task). Memory stays per range: ranges are read in turn.
    """
    total = sum(t.end - t.start for t in tasks)
    count = min(len(tasks), max(1, slots, -(-total // max_records)))
    groups: list[list[TaskRange]] = [[] for _ in range(count)]
    load = [0] * count
    for task in sorted(tasks, key=lambda t: (t.start - t.end, t.partition, t.start)):
        lightest = load.index(min(load))
        groups[lightest].append(task)
        load[lightest] += task.end - task.start
    return [sorted(group, key=lambda t: (t.partition, t.start)) for group in groups if group]


def check_continuity(
    pipeline: Pipeline,
    ledger: Ledger,
    table,
    positions: Mapping[int, int | None],
    identity: TopicIdentity,
    log: Mapping[int, PartitionBounds],
) -> None:
    """Refuses to plan when the table's positions cannot be trusted to continue on this topic:
    the topic ingested there by another pipeline, positions missing from a table that holds data
    or commits, another cluster, a recreated topic (new topic ID), or a position beyond the log
    end. Nothing has been read yet."""
    topic = pipeline.source.topic
    where = f"pipeline {pipeline.name}: topic {topic}"
    if table is None:
        return
    check_owner(pipeline, ledger, table)
    if all(v is None for v in positions.values()):
        version = table.version()
        # Data, or an oncemore commit: a table only created or altered (constraints, properties) is new.
        if table.get_add_actions(flatten=False).num_rows or ledger.last_commit(table) is not None:
            raise PositionsMissing(
                f"{where}: table {pipeline.sink.table_uri} (version {version}) holds commits or data but no "
                f"positions for this pipeline and topic{_missing_hint(ledger, table)}. They expired "
                "(delta.setTransactionRetentionDuration), the pipeline was renamed, or another tool wrote the "
                "table; oncemore does not ingest from starting_offsets over them. Set positions deliberately: "
                f"`oncemore reset {pipeline.name} --to earliest|latest|TIMESTAMP|'{{\"0\": OFFSET}}'`.",
                pipeline=pipeline.name, topic=topic, table_uri=pipeline.sink.table_uri, version=version,
            )
        return
    check_identity(pipeline, ledger, table, identity, positions)
    for partition, position in sorted(positions.items()):
        if position is not None and position > log[partition].latest:
            raise TopicChanged(
                f"{where}/{partition}: committed position {position} is beyond the log end "
                f"{log[partition].latest} (log start {log[partition].earliest}): the topic was recreated or "
                f"truncated. oncemore never resets positions by itself: `oncemore reset {pipeline.name} --to ...`.",
                pipeline=pipeline.name, topic=topic, partition=partition, position=position,
                log_end=log[partition].latest,
            )


def check_identity(pipeline: Pipeline, ledger: Ledger, table, identity: TopicIdentity,
                   positions: Mapping[int, int | None]) -> None:
    """The positions refer to the topic and cluster the broker reports now. The snapshot holds
    their fingerprints beside the positions; a table whose commits predate them (format < 4) is
    checked against its newest commit record, searched through the whole log once (the next
    commit records the fingerprints)."""
    topic, claims = pipeline.source.topic, ledger.claims(table)
    where = f"pipeline {pipeline.name}: topic {topic}"
    if claims.topic_id is not None or claims.cluster_id is not None:
        cluster_changed = bool(identity.cluster_id) and claims.cluster_id not in (None, NO_ID, fingerprint(identity.cluster_id))
        topic_changed = bool(identity.topic_id) and claims.topic_id not in (None, NO_ID, fingerprint(identity.topic_id))
        if not (cluster_changed or topic_changed):
            return
        last = ledger.last_commit(table)  # only to name the IDs in the error, when still in recent history
        committed = last.record if last is not None else None
    else:
        last = ledger.last_commit(table, limit=None)
        committed = last.record if last is not None else None
        cluster_changed = bool(committed and committed.cluster_id and identity.cluster_id
                               and committed.cluster_id != identity.cluster_id)
        topic_changed = bool(committed and committed.topic_id and identity.topic_id and committed.topic_id != identity.topic_id)
    version = f"version {last.version}" if last is not None else f"before version {table.version() + 1}"
    if cluster_changed:
        before = committed.cluster_id if committed and committed.cluster_id else "another cluster"
        raise TopicChanged(
            f"{where}: the positions were committed ({version}) reading cluster {before}, the broker at "
            f"{pipeline.source.bootstrap_servers} is cluster {identity.cluster_id}: offsets of another cluster mean "
            f"nothing here. Point the pipeline back, or start over deliberately with `oncemore reset {pipeline.name} --to ...`.",
            pipeline=pipeline.name, topic=topic, committed_cluster_id=committed.cluster_id if committed else None,
            cluster_id=identity.cluster_id,
        )
    if topic_changed:
        before = committed.topic_id if committed and committed.topic_id else "another topic ID"
        raise TopicChanged(
            f"{where}: the topic was deleted and recreated: positions {_positions_text(positions)} were committed "
            f"({version}) for topic ID {before}, the topic now has ID {identity.topic_id}. Its offsets start over, "
            f"so nothing is read; to ingest the new topic, `oncemore reset {pipeline.name} --to earliest` (or "
            "latest, a timestamp, offsets).",
            pipeline=pipeline.name, topic=topic, committed_topic_id=committed.topic_id if committed else None,
            topic_id=identity.topic_id, positions=dict(positions),
        )


def check_owner(pipeline: Pipeline, ledger: Ledger, table, take_over: bool = False) -> None:
    """Refuses a pipeline's commits for a topic that another pipeline ingests into the same table:
    both would plan the same ranges, duplicating every record. A deliberate hand-over (``oncemore
    reset --take-over``) passes; its commit makes this pipeline the owner, and the other one's
    runs are refused from then on."""
    if take_over or table is None:
        return
    owner, mine = ledger.claims(table).owner, fingerprint(pipeline.name)
    if owner == mine:
        return
    recent = ledger.recent_commits(RECENT_HISTORY, table)
    if owner is None:  # commits before format 4 name no owner: their records still tell
        others = [e for e in recent if e.record.topic == pipeline.source.topic and e.record.pipeline != pipeline.name]
        if not others:
            return
        other = others[0].record.pipeline
    else:
        known = {fingerprint(name): name for name in [e.record.pipeline for e in recent] + known_pipeline_names()}
        other = known.get(owner, "another pipeline (not among this table's recent commits or the configured pipelines)")
    raise TableOwned(
        f"pipeline {pipeline.name}: topic {pipeline.source.topic} is ingested into {pipeline.sink.table_uri} by "
        f"pipeline {other}; a table belongs to one pipeline, and a second one would ingest every record again. "
        f"Point {pipeline.name} at another table, or hand the topic over deliberately: `oncemore reset "
        f"{pipeline.name} --to ... --take-over` ({other}'s runs are refused from then on).",
        pipeline=pipeline.name, topic=pipeline.source.topic, table_uri=pipeline.sink.table_uri, owner=other,
    )


def _positions_text(positions: Mapping[int, int | None]) -> str:
    return json.dumps({str(p): v for p, v in sorted(positions.items())})


def _missing_hint(ledger: Ledger, table) -> str:
    """What recent history says about the missing positions: this pipeline's last ranges, or
    which pipelines did commit here (a rename)."""
    commits = ledger.recent_commits(50, table)
    own = [c for c in commits if c.record.pipeline == ledger.pipeline and c.record.topic == ledger.topic]
    if own:
        ends = {p: end for ranges in own[0].record.ranges.values() for p, (_, end) in ranges.items()}
        if own[0].record.reset is not None:
            ends = dict(own[0].record.reset.to_positions)
        return f" (its newest commit, version {own[0].version}, left positions at {json.dumps(ends, sort_keys=True)})"
    others = sorted({f"{c.record.pipeline}/{c.record.topic}" for c in commits})
    return f" (recent oncemore commits here are by {', '.join(others)})" if others else ""


def plan_run(pipeline: Pipeline, until: OffsetBound = LATEST, admin: AdminClient | None = None) -> Plan:
    """Reads the ledger and the log, checks they still belong together, then plans."""
    admin = admin or kafka.admin_client(pipeline)
    state = kafka.describe_topic(admin, pipeline)
    log = kafka.log_bounds(admin, pipeline, state.partitions)
    ledger = Ledger(pipeline.sink.table_uri, pipeline.name, pipeline.source.topic, pipeline.sink.storage_options)
    table = ledger.snapshot()
    positions = ledger.positions(state.partitions, table)
    check_continuity(pipeline, ledger, table, positions, state.identity, log)
    earliest = {p: b.earliest for p, b in log.items()}
    if all(v is None for v in positions.values()):
        starts = bounds_.resolve(admin, pipeline, pipeline.source.starting_offsets, log,
                                 range_starts={p: None for p in log}, default=earliest)
    else:
        starts = earliest  # partitions added after the first commit start at their beginning
    range_starts = {p: positions[p] if positions[p] is not None else starts[p] for p in log}
    # Explicit `until` offsets leave unnamed partitions where they are.
    ends = bounds_.resolve(admin, pipeline, until, log, range_starts, default={p: None for p in log})
    return plan(pipeline, positions, log, starts, ends, until=until.describe(), identity=state.identity)


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
