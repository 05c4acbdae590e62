"""What one oncemore commit did, as stored in its commitInfo under the key ``oncemore``: a batch
(ranges, records, gaps, the log end it planned to, how long it took) or a deliberate reset (old
and new positions), and the topic IDs and cluster ID the offsets refer to.

A contract: the CLI, Airflow's report task, the UI and ``oncemore verify`` read it. Every format
ever written stays readable: ``from_json`` brings older records to the current shape.

Formats: 1 the batch; 2 topic, topic_id, cluster_id, bytes_read and reset; 3 log_end and
duration_ms; 4 the commit also states the identity and owner txns (ledger.Claims); 5 several
topics: ``topic_ids`` {topic: ID} instead of topic/topic_id, ``log_end`` and reset positions per
topic, ``records.filtered`` (records a transform dropped) and ``expectations`` (rows failing each);
6 ``profile``: milliseconds per phase of the work before the commit (core/stopwatch.py); 7 ``deletion``:
rows a deliberate deletion (``oncemore delete``) removed from the table, by their offsets; 8
``stream_ms``: per partition of an upsert batch, the greatest Kafka timestamp of its change events
(the stream's time ``oncemore maintain`` measures tombstone retention in), and ``resequence``: an
accepted change of ``upsert.sequence_by`` (``oncemore resequence``), from and to; 9 ``hours``: rows
written and quarantined per hour of their Kafka timestamp (core/hours.py), and
``quarantine_accepted``: the batch quarantined more than the pipeline's limit and a run accepting
it committed it (commit/share.py); 10 routes (config/routes.py): ``route``, the route whose table a
commit is in, and ``records.unrouted``, in a routed pipeline's quarantine table, the records no route
took that the pipeline skips. Each of a routed pipeline's tables records its own range and what of
it is its own: a route table's commit its ``written`` rows, the quarantine table's its
``quarantined`` rows and the ``unrouted`` records skipped; the quarantine table's commits record
the ``routes`` they were made under (RoutesInForce, plan/tables.py); without routes, ``judging``: a
fingerprint of the settings that judged which records are rows and which are quarantined.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from oncemore import __version__
from oncemore.core.coordinates import KafkaPartition, flat

METADATA_KEY = "oncemore"
FORMAT_VERSION = 10

Nested = Mapping[str, Mapping[str, Any]]  # {topic: {partition: value}}


@dataclass(frozen=True)
class Gap:
    """Offsets skipped because the log no longer held them (fail_on_data_loss: false)."""

    topic: str
    partition: int
    start: int
    end: int


@dataclass(frozen=True)
class Reset:
    """A deliberate move of positions (``oncemore reset``): from where to where, per partition."""

    from_positions: Nested  # {topic: {partition: offset or None}}
    to_positions: Nested
    to: str  # the bound as the user stated it


@dataclass(frozen=True)
class Deletion:
    """Rows removed on purpose (``oncemore delete``): the predicate as the user stated it, and the
    offsets of the removed rows, as spans per partition."""

    where: str
    offsets: Mapping[str, Mapping[str, list[list[int]]]]  # {topic: {partition: [[start, end], ...]}}, end excluded
    rows: int

    def spans(self) -> dict[KafkaPartition, list[tuple[int, int]]]:
        return {p: [(s, e) for s, e in spans] for p, spans in flat(self.offsets).items()}


@dataclass(frozen=True)
class RoutesInForce:
    """The routes a routed pipeline's quarantine commit was made under: ``by``, ``unrouted``, each
    route's table (its location, core/storage.table_key) and a fingerprint of how its records are
    decoded (``decoding``: its format and the pipeline's key format, never a registry's settings)
    by the value of ``by``, and ``since``: for a route whose table may not yet hold a position
    where the route came into force, that offset per partition (plan/tables.py)."""

    by: str
    unrouted: str
    tables: Mapping[str, str]
    decoding: Mapping[str, str] = field(default_factory=dict)  # {value: fingerprint}
    since: Mapping[str, Nested] = field(default_factory=dict)  # {value: {topic: {partition: offset}}}

    def same_routes(self, other: "RoutesInForce") -> bool:
        """Whether ``other`` routes and decodes every record as these do (``since`` aside)."""
        return ((self.by, self.unrouted, dict(self.tables), dict(self.decoding))
                == (other.by, other.unrouted, dict(other.tables), dict(other.decoding)))

    def describe(self) -> str:
        tables = ", ".join(f"{value} -> {uri}" for value, uri in sorted(self.tables.items()))
        return f"by {self.by}, unrouted {self.unrouted}, tables {tables}"

    def changes_to(self, other: "RoutesInForce") -> str:
        """What ``other`` changes of these routes, in words."""
        changes = [f"{what} {mine} -> {theirs}" for what, mine, theirs in (
            ("by", self.by, other.by), ("unrouted", self.unrouted, other.unrouted)) if mine != theirs]
        for value in sorted(set(self.tables) | set(other.tables)):
            mine, theirs = self.tables.get(value), other.tables.get(value)
            if mine is None or theirs is None:
                changes.append(f"route {value} {'added' if mine is None else 'removed'}")
            elif mine != theirs:
                changes.append(f"route {value}'s table {mine} -> {theirs}")
            elif self.decoding.get(value) != other.decoding.get(value):
                changes.append(f"route {value}'s format (or the key's)")
        return ", ".join(changes)


@dataclass(frozen=True)
class CommitInfo:
    pipeline: str
    run_id: str
    batch_seq: int = 0
    until: str | None = None
    ranges: Nested = field(default_factory=dict)  # {topic: {partition: [start, end]}}
    records: Mapping[str, int] = field(default_factory=lambda: {"written": 0, "quarantined": 0, "filtered": 0})
    expectations: Mapping[str, int] = field(default_factory=dict)  # {name: rows failing it}, quarantined or not
    gaps: list[Gap] = field(default_factory=list)
    topic_ids: Mapping[str, str | None] = field(default_factory=dict)
    cluster_id: str | None = None
    bytes_read: int = 0
    log_end: Nested = field(default_factory=dict)  # {topic: {partition: last stable offset when planned}}
    duration_ms: int = 0  # reading, writing and committing this batch
    profile: Mapping[str, int] = field(default_factory=dict)  # {phase: ms} (core/stopwatch.py)
    hours: Mapping[str, list[int]] = field(default_factory=dict)  # {hour: [written, quarantined]} (core/hours.py)
    quarantine_accepted: bool = False  # over the quarantine limit, committed by a run that accepts it
    reset: Reset | None = None
    deletion: Deletion | None = None
    stream_ms: Nested = field(default_factory=dict)  # {topic: {partition: ms}}: upserts, the greatest Kafka timestamp read
    resequence: Mapping[str, str] | None = None  # {"from": expression, "to": expression}; "": none
    route: str | None = None  # a routed pipeline's route table: the route (the value of routes.by)
    routes: RoutesInForce | None = None  # a routed pipeline's quarantine table: the routes it committed under
    judging: str | None = None  # without routes: what judged rows from quarantined records (plan/tables.judging)
    format_version: int = FORMAT_VERSION
    oncemore_version: str = __version__

    @property
    def topics(self) -> list[str]:
        return sorted(set(self.ranges) | set(self.topic_ids))

    def partition_ranges(self) -> dict[KafkaPartition, tuple[int, int]]:
        return {key: (start, end) for key, (start, end) in flat(self.ranges).items()}

    def lag(self) -> dict[KafkaPartition, int]:
        """Records each partition of the batch was behind its log end (as planned) once committed."""
        ends = flat(self.log_end)
        return {key: max(ends[key] - end, 0) for key, (_, end) in self.partition_ranges().items() if key in ends}

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CommitInfo":
        data = json.loads(text)
        version = data.get("format_version", 1)
        if version < 5:
            # One topic, named by `topic` (format 1: only by its ranges); partitions keyed alone.
            topic = data.pop("topic", None) or next(iter(data.get("ranges") or {}), None)
            topic_id = data.pop("topic_id", None)
            data["topic_ids"] = {topic: topic_id} if topic is not None else {}
            if topic is not None:
                data["log_end"] = {topic: data["log_end"]} if data.get("log_end") else {}
                if data.get("reset"):
                    data["reset"] = {**data["reset"], "from_positions": {topic: data["reset"]["from_positions"]},
                                     "to_positions": {topic: data["reset"]["to_positions"]}}
        data["gaps"] = [Gap(**g) for g in data.get("gaps", [])]
        if data.get("reset"):
            data["reset"] = Reset(**data["reset"])
        if data.get("deletion"):
            data["deletion"] = Deletion(**data["deletion"])
        if data.get("routes"):
            data["routes"] = RoutesInForce(**data["routes"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class CommitEntry:
    version: int
    timestamp_ms: int
    record: CommitInfo
