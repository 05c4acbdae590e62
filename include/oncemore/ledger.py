"""The ledger: a pipeline's positions and batch history, kept in the Delta table's own log.

Format (a contract; the CLI, Airflow's report task, the UI and other tools read it):
- a Delta ``txn`` action per partition, appId ``oncemore/<pipeline>/<topic>/<partition>``,
  version = the next offset to read, ``lastUpdated`` = the commit's time. Every oncemore commit
  re-states the position of *every* partition the pipeline holds, moved or not, so that
  ``delta.setTransactionRetentionDuration`` can only expire the positions of a pipeline that
  has not committed for that long (delta-rs drops expired txns when it reads a snapshot);
- the commit's commitInfo carries a CommitRecord as JSON under the key ``oncemore``: the batch
  (ranges, records, gaps, the log end it planned to and how long it took) or a deliberate reset
  (old and new positions), and the topic ID and cluster ID the offsets refer to.
Positions come from the snapshot's txn actions (kept by checkpoints), never from a history scan;
only the identity check and reports read recent history, newest first and bounded.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from deltalake import DeltaTable, Transaction
from deltalake.exceptions import TableNotFoundError

from . import __version__

METADATA_KEY = "oncemore"
# 2: topic, topic_id, cluster_id, bytes_read and reset added; 3: log_end and duration_ms added.
# Older records still read (their lag and duration are unknown).
FORMAT_VERSION = 3
# Commits read back when looking for this pipeline's newest commit (its identity).
RECENT_HISTORY = 100


def app_id(pipeline: str, topic: str, partition: int) -> str:
    return f"oncemore/{pipeline}/{topic}/{partition}"


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

    from_positions: Mapping[str, int | None]
    to_positions: Mapping[str, int]
    to: str  # the bound as the user stated it


@dataclass(frozen=True)
class CommitRecord:
    """What one oncemore commit did, as stored in its metadata."""

    pipeline: str
    run_id: str
    batch_seq: int = 0
    until: str | None = None
    ranges: Mapping[str, Mapping[str, list[int]]] = field(default_factory=dict)  # {topic: {partition: [start, end]}}
    records: Mapping[str, int] = field(default_factory=lambda: {"written": 0, "quarantined": 0})
    gaps: list[Gap] = field(default_factory=list)
    topic: str | None = None
    topic_id: str | None = None
    cluster_id: str | None = None
    bytes_read: int = 0
    log_end: Mapping[str, int] = field(default_factory=dict)  # {partition: last stable offset when planned}
    duration_ms: int = 0  # reading, writing and committing this batch
    reset: Reset | None = None
    format_version: int = FORMAT_VERSION
    oncemore_version: str = __version__

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def lag(self) -> dict[int, int]:
        """Records each partition of the batch was behind its log end (as planned) once committed."""
        ranges = self.ranges.get(self.topic, {}) if self.topic else {}
        return {int(p): max(self.log_end[p] - end, 0) for p, (_, end) in ranges.items() if p in self.log_end}

    @classmethod
    def from_json(cls, text: str) -> "CommitRecord":
        data = json.loads(text)
        data["gaps"] = [Gap(**g) for g in data.get("gaps", [])]
        if data.get("reset"):
            data["reset"] = Reset(**data["reset"])
        if data.get("topic") is None and data.get("ranges"):  # format 1 named the topic only in ranges
            data["topic"] = next(iter(data["ranges"]))
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class CommitEntry:
    version: int
    timestamp_ms: int
    record: CommitRecord


def open_table(table_uri: str, storage_options: Mapping[str, str] | None = None) -> DeltaTable | None:
    """The table's latest snapshot, or None when no table exists there yet."""
    try:
        return DeltaTable(table_uri, storage_options=dict(storage_options) if storage_options else None)
    except TableNotFoundError:
        return None


class Ledger:
    """Positions and commit history of one pipeline and topic in one Delta table."""

    def __init__(self, table_uri: str, pipeline: str, topic: str, storage_options: Mapping[str, str] | None = None):
        self.table_uri, self.pipeline, self.topic = table_uri, pipeline, topic
        self.storage_options = storage_options

    def table(self) -> DeltaTable | None:
        return open_table(self.table_uri, self.storage_options)

    def positions(self, partitions: Iterable[int], table: DeltaTable | None = None) -> dict[int, int | None]:
        """Next offset to read per partition; None where nothing was committed yet.

        Pass ``table`` to read the positions of exactly that snapshot (the commit re-check does).
        """
        table = table if table is not None else self.table()
        if table is None:
            return {p: None for p in partitions}
        return {p: table.transaction_version(app_id(self.pipeline, self.topic, p)) for p in partitions}

    def transactions(self, new_positions: Mapping[int, int], partitions: Iterable[int], table: DeltaTable) -> list[Transaction]:
        """The txn actions of a commit on ``table``'s snapshot: ``new_positions``, and every other
        partition's held position re-stated, all stamped now (so none expires while the pipeline runs)."""
        now_ms = int(time.time() * 1000)
        held = {p: v for p, v in self.positions(set(partitions) - set(new_positions), table).items() if v is not None}
        return [Transaction(app_id(self.pipeline, self.topic, p), v, now_ms)
                for p, v in sorted({**held, **new_positions}.items())]

    def recent_commits(self, limit: int = 20, table: DeltaTable | None = None) -> list[CommitEntry]:
        """The newest oncemore commits of any pipeline among the last ``limit`` commits, newest first."""
        table = table if table is not None else self.table()
        if table is None:
            return []
        entries = []
        for commit in table.history(limit):
            raw = commit.get(METADATA_KEY)
            if raw is not None:
                record = CommitRecord.from_json(raw if isinstance(raw, str) else json.dumps(raw))
                entries.append(CommitEntry(commit["version"], commit["timestamp"], record))
        return entries

    def recent_batches(self, limit: int = 20, table: DeltaTable | None = None) -> list[CommitEntry]:
        """This pipeline's commits on this topic among the last ``limit`` commits, newest first."""
        return [e for e in self.recent_commits(limit, table)
                if e.record.pipeline == self.pipeline and e.record.topic == self.topic]

    def last_commit(self, table: DeltaTable | None = None) -> CommitEntry | None:
        """This pipeline's newest commit within the last RECENT_HISTORY commits."""
        batches = self.recent_batches(RECENT_HISTORY, table)
        return batches[0] if batches else None
