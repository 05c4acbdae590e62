"""What a part's commit takes from the tasks that read it, the one type both ways of reading hand
over (the ingest job's manifest rows, the sink's staging area): a RangeResult per range read,
where a range stopped for a writer schema ahead of the reader (AheadRecord), and where an upsert
part's change rows are staged.

Invariant: a RangeResult accounts for every offset of [start, reached): each is a record written,
a record quarantined, or an offset that holds no record (a transaction marker, an aborted record).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping

from oncemore.core.columns import MAIN_TAG
from oncemore.core.coordinates import KafkaPartition
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
