"""What a part's commit takes: the part as the run planned it (Part, an upsert's UpsertSpec), which
travels to the tasks as JSON; and from the tasks that read it, the one type both ways of reading
hand over (the ingest job's manifest rows, the part's staging area): a
RangeResult per range read, where a range stopped for a writer schema ahead of the reader
(AheadRecord), and where an upsert part's change rows are staged. Nothing here commits: a
process that only reads or writes a part's rows imports this, not delta-rs (commit/part.py).

Invariant: a RangeResult accounts for every offset of [start, reached): each is a record written,
a record quarantined, or an offset that holds no record (a transaction marker, an aborted record).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Mapping

from oncemore.commit.share import QuarantineLimit
from oncemore.core.columns import MAIN_TAG, QUARANTINE_TAG
from oncemore.core.coordinates import KafkaPartition, by_text, from_text
from oncemore.plan.commitinfo import Gap, RoutesInForce
from oncemore.write.files import DataFile

# Under the quarantine table: each part's staging area (run/staging.py), and an upsert part's change
# rows in its ``changes`` directory (their files' tag).
STAGING_DIR = "_oncemore_staging"
CHANGES_TAG = "changes"


def changes_uri(quarantine_uri: str, staging_id: str) -> str:
    """Where an upsert part's tasks write its change rows (Parquet) for its MERGE."""
    return f"{quarantine_uri.rstrip('/')}/{STAGING_DIR}/{staging_id}/changes"


@dataclass(frozen=True)
class AheadRecord:
    """The record a range stopped at because its key's or value's writer schema has what the reader
    lacks (SchemaAhead): where it is and that writer schema. Travels to the driver as text
    (``value:7@orders/0:15``) in RangeResult.schema_ahead and the part's outcome."""

    role: str  # "value" or "key"
    schema_id: int
    topic: str
    partition: int
    offset: int
    table: str = MAIN_TAG  # the tag of the table whose reader it is ahead of (a route's: its own format)

    def __str__(self) -> str:
        text = f"{self.role}:{self.schema_id}@{KafkaPartition(self.topic, self.partition)}:{self.offset}"
        return text if self.table == MAIN_TAG else f"{text}#{self.table}"

    @classmethod
    def parse(cls, text: str) -> "AheadRecord":
        text, _, table = text.partition("#")
        writer, _, coordinates = text.partition("@")
        role, _, schema_id = writer.partition(":")
        at, _, offset = coordinates.rpartition(":")
        where = KafkaPartition.parse(at)
        return cls(role, int(schema_id), where.topic, where.partition, int(offset), table or MAIN_TAG)


@dataclass(frozen=True)
class RangeResult:
    """What reading one range [start, end) did: offsets [start, reached) were read (a byte budget or
    a writer schema ahead of the reader may stop it early: ``schema_ahead`` says where, an
    AheadRecord as text), holding ``records`` data records (transaction markers and aborted records
    hold offsets but no record), ``quarantined`` of which could not be stored, ``unrouted`` no
    route took and the pipeline skips (routes.unrouted: skip), and ``held`` a table already held
    (below its floor: a crash between a part's commits committed them; not written again);
    ``files`` hold what this task wrote of them; ``seconds`` what the range took to read, decode
    and write (core/stopwatch.py); ``hours`` its rows written and quarantined by the hour of their
    Kafka timestamp (rows a transform shapes are counted where the sink writes them,
    run/deltasink.py), and with routes ``table_hours`` the same per table, of the rows written."""

    topic: str
    partition: int
    start: int
    end: int
    reached: int
    bytes_read: int
    records: int
    quarantined: int
    files: tuple[DataFile, ...]
    schema_ahead: str | None = None  # str(AheadRecord)
    seconds: Mapping[str, float] = field(default_factory=dict)  # {read, decode, write}
    hours: Mapping[str, list[int]] = field(default_factory=dict)  # core/hours.py: of the rows this task stored
    unrouted: int = 0  # skipped at or after the quarantine table's floor
    held: int = 0
    table_hours: Mapping[str, Mapping[str, list[int]]] = field(default_factory=dict)  # {tag: hours}

    @property
    def key(self) -> KafkaPartition:
        return KafkaPartition(self.topic, self.partition)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RangeResult":
        data = json.loads(text)
        return cls(**{**data, "files": tuple(DataFile.from_dict(f) for f in data["files"])})


@dataclass(frozen=True)
class RouteTable:
    """A routed part's table (config/routes.py): its tag and route, where it is, and per partition
    of the part the position it builds on (``expected``: its own; None where it holds none) and the
    first offset it takes (``floors``: plan/tables.py), so the range it consumed is [floor, end)."""

    tag: str
    route: str
    table_uri: str
    partition_by: tuple[str, ...]
    expected: Mapping[KafkaPartition, int | None]
    floors: Mapping[KafkaPartition, int]

    def ranges(self, read: Mapping[KafkaPartition, tuple[int, int]]) -> dict[KafkaPartition, tuple[int, int]]:
        """The range this table consumed of ``read``: per partition it does not hold to its end yet
        and whose floor the part reaches, [floor, end), or from its own position where that lies
        below (a route re-added: the records between were routed by the routes of then), so its
        positions run on unbroken. A floor beyond the part's end is no range: the table's
        positions never move back."""
        found = {}
        for p, (start, end) in read.items():
            own, floor = self.expected.get(p), max(start, self.floors.get(p, start))
            if (own is None or own < end) and floor <= end:
                found[p] = (floor if own is None else min(own, floor), end)
        return found

    def to_dict(self) -> dict:
        return {"tag": self.tag, "route": self.route, "table_uri": self.table_uri, "partition_by": list(self.partition_by),
                "expected": {str(p): v for p, v in self.expected.items()},
                "floors": {str(p): v for p, v in self.floors.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> "RouteTable":
        return cls(data["tag"], data["route"], data["table_uri"], tuple(data["partition_by"]),
                   {KafkaPartition.parse(p): v for p, v in data["expected"].items()},
                   {KafkaPartition.parse(p): v for p, v in data["floors"].items()})


@dataclass(frozen=True)
class UpsertSpec:
    """What a part's MERGE needs of the pipeline's upsert block; travels in the part's JSON."""

    keys: tuple[str, ...]  # as the table names them
    sequenced: bool
    tombstones_uri: str | None
    placeholder: str | None = None  # upsert.unavailable_value_placeholder: a column value that is not sent
    sequence_by: str | None = None  # the expression, checked against the table's record at each commit
    merge: str = "local"  # upsert.merge: where the main MERGE runs (commit/merge.py)


@dataclass(frozen=True)
class Part:
    """One part of a batch as the run planned it: what it reads from where, what it builds on, and
    what its commits record. JSON, so it can travel to Spark's tasks."""

    pipeline: str
    run_id: str
    batch_seq: int
    until: str
    table_uri: str | None  # the main table (None: routes)
    quarantine_uri: str
    partition_by: tuple[str, ...]
    starts: Mapping[KafkaPartition, int]  # where each partition's part begins (where the pipeline stands, or the batch start)
    expected: Mapping[KafkaPartition, int | None]  # the main table's positions it builds on
    quarantine_expected: Mapping[KafkaPartition, int | None]  # the quarantine table's
    partitions: tuple[KafkaPartition, ...]  # every partition of the plan (positions are all re-stated)
    gaps: tuple[Gap, ...]
    topic_ids: Mapping[str, str | None]
    cluster_id: str | None
    log_end: Mapping[KafkaPartition, int]
    quarantine_limit: QuarantineLimit  # the pipeline's quarantine block, and whether this run accepts more
    started_ms: int = field(default_factory=lambda: int(time.time() * 1000))  # its Spark job submitted
    profile: Mapping[str, int] = field(default_factory=dict)  # the run's own phases, in the run's first part
    may_filter: bool = False  # a transform may drop records; without one, every record read is a row
    upsert: UpsertSpec | None = None  # change rows MERGEd by key (merge.py); None: an append
    routes: tuple[RouteTable, ...] = ()  # a routed pipeline's tables (routed.py), in the pipeline's order
    routes_before: RoutesInForce | None = None  # the routes in force when it was planned (plan/tables.py)
    routes_in_force: RoutesInForce | None = None  # what its quarantine commit records
    judging: str | None = None  # without routes: what its commits record as judging its records (plan/tables.py)

    @property
    def changes_uri(self) -> str:
        """Where the tasks stage an upsert part's change rows."""
        return changes_uri(self.quarantine_uri, self.staging_id)

    @property
    def merges_on_cluster(self) -> bool:
        """An upsert whose MERGE is a Spark job (``upsert.merge: cluster``): the run commits it."""
        return self.upsert is not None and self.upsert.merge == "cluster"

    @property
    def staging_id(self) -> str:
        """The part's directory in the staging area (staging.py)."""
        return f"{self.run_id}-{self.batch_seq}-{self.started_ms}"

    def tables(self) -> dict[str, str]:
        """Every table of the part by tag (core/columns.py), the quarantine table's included."""
        tables = {QUARANTINE_TAG: self.quarantine_uri, **{t.tag: t.table_uri for t in self.routes}}
        return {MAIN_TAG: self.table_uri, **tables} if self.table_uri is not None else tables

    def to_json(self) -> str:
        data = asdict(self)
        for name in ("starts", "expected", "quarantine_expected", "log_end"):
            data[name] = by_text(getattr(self, name))
        data["partitions"] = [str(p) for p in self.partitions]
        data["routes"] = [t.to_dict() for t in self.routes]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Part":
        data = json.loads(text)
        for name in ("starts", "expected", "quarantine_expected", "log_end"):
            data[name] = from_text(data[name])
        data["partitions"] = tuple(KafkaPartition.parse(p) for p in data["partitions"])
        data["partition_by"] = tuple(data["partition_by"])
        data["gaps"] = tuple(Gap(**g) for g in data["gaps"])
        data["quarantine_limit"] = QuarantineLimit(**data["quarantine_limit"])
        if data["upsert"] is not None:
            data["upsert"] = UpsertSpec(**{**data["upsert"], "keys": tuple(data["upsert"]["keys"])})
        data["routes"] = tuple(RouteTable.from_dict(t) for t in data["routes"])
        for name in ("routes_before", "routes_in_force"):
            data[name] = data[name] and RoutesInForce(**data[name])
        return cls(**data)
