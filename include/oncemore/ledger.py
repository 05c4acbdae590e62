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

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from deltalake import DeltaTable, Transaction
from deltalake.exceptions import TableNotFoundError

from . import __version__

METADATA_KEY = "oncemore"
# 2: topic, topic_id, cluster_id, bytes_read and reset added; 3: log_end and duration_ms added;
# 4: the commit also states the identity and owner txns (Claims). Older records still read
# (their lag and duration are unknown).
FORMAT_VERSION = 4
# Commits read back when looking for this pipeline's newest commit (its identity).
RECENT_HISTORY = 100


def app_id(pipeline: str, topic: str, partition: int) -> str:
    return f"oncemore/{pipeline}/{topic}/{partition}"


def identity_app_id(pipeline: str, topic: str, what: str) -> str:
    """The txn holding the fingerprint of the topic ID or cluster ID the positions refer to."""
    return f"oncemore/{pipeline}/{topic}/@{what}"


def owner_app_id(topic: str) -> str:
    """The txn holding the fingerprint of the pipeline that ingests ``topic`` into the table.
    (Pipeline names never start with @, so this never collides with a pipeline's app ids.)"""
    return f"oncemore/@owner/{topic}"


def fingerprint(text: str) -> int:
    """A txn version standing for ``text`` (a txn holds an integer): 63 bits of its SHA-256."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1 or 1


# The identity txn of a broker that reported no ID (Kafka before 2.8 has no topic IDs): recorded,
# so the snapshot still says its identity was looked at, and never compared.
NO_ID = 0


@dataclass(frozen=True)
class Claims:
    """What a snapshot says its positions belong to, as fingerprints (None: not recorded; tables
    whose commits predate format 4 carry their identity only in commit records)."""

    topic_id: int | None
    cluster_id: int | None
    owner: int | None


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
    """Positions, claims and commit history of one pipeline and topic in one Delta table.

    The table's snapshot is loaded once and then brought up to date incrementally (``snapshot()``);
    txn lookups are remembered per snapshot version, and history per commit version, so asking
    the same question twice reads nothing twice (each delta-rs lookup replays the log).
    """

    def __init__(self, table_uri: str, pipeline: str, topic: str, storage_options: Mapping[str, str] | None = None):
        self.table_uri, self.pipeline, self.topic = table_uri, pipeline, topic
        self.storage_options = storage_options
        self._table: DeltaTable | None = None
        self._txns: tuple[int, dict[str, int | None]] = (-1, {})  # the lookups of one snapshot version
        # (version, timestamp, record) newest first: every commit in versions _covered = (low, high).
        self._history: list[tuple[int, int, CommitRecord | None]] = []
        self._covered: tuple[int, int] | None = None

    def snapshot(self) -> DeltaTable | None:
        """The table's latest snapshot (None: no table yet). The same object each call, updated."""
        if self._table is None:
            self._table = open_table(self.table_uri, self.storage_options)
        else:
            self._table.update_incremental()
        return self._table

    def _txn(self, table: DeltaTable, app: str) -> int | None:
        version, known = self._txns
        if version != table.version():
            version, known = self._txns = (table.version(), {})
        if app not in known:
            known[app] = table.transaction_version(app)
        return known[app]

    def positions(self, partitions: Iterable[int], table: DeltaTable | None = None) -> dict[int, int | None]:
        """Next offset to read per partition; None where nothing was committed yet.

        Pass ``table`` to read the positions of exactly that snapshot (the commit re-check does);
        without it, of the latest snapshot.
        """
        table = table if table is not None else self.snapshot()
        if table is None:
            return {p: None for p in partitions}
        return {p: self._txn(table, app_id(self.pipeline, self.topic, p)) for p in partitions}

    def claims(self, table: DeltaTable | None = None) -> Claims:
        """The identity and owner fingerprints ``table`` (default: the latest snapshot) holds."""
        table = table if table is not None else self.snapshot()
        if table is None:
            return Claims(None, None, None)
        return Claims(topic_id=self._txn(table, identity_app_id(self.pipeline, self.topic, "topic_id")),
                      cluster_id=self._txn(table, identity_app_id(self.pipeline, self.topic, "cluster_id")),
                      owner=self._txn(table, owner_app_id(self.topic)))

    def transactions(self, new_positions: Mapping[int, int], partitions: Iterable[int], table: DeltaTable,
                     record: "CommitRecord") -> list[Transaction]:
        """The txn actions of a commit on ``table``'s snapshot: ``new_positions``, every other
        partition's held position re-stated, the topic and cluster the offsets refer to (the
        record's, else the held ones) and this pipeline as the topic's owner; all stamped now, so
        none expires while the pipeline runs."""
        now_ms = int(time.time() * 1000)
        held = {p: v for p, v in self.positions(set(partitions) - set(new_positions), table).items() if v is not None}
        actions = [Transaction(app_id(self.pipeline, self.topic, p), v, now_ms)
                   for p, v in sorted({**held, **new_positions}.items())]
        claims = self.claims(table)
        for what, stated, kept in (("topic_id", record.topic_id, claims.topic_id),
                                   ("cluster_id", record.cluster_id, claims.cluster_id)):
            value = fingerprint(stated) if stated else kept if kept is not None else NO_ID
            actions.append(Transaction(identity_app_id(self.pipeline, self.topic, what), value, now_ms))
        actions.append(Transaction(owner_app_id(self.topic), fingerprint(self.pipeline), now_ms))
        return actions

    def _commits(self, limit: int | None, table: DeltaTable) -> list[tuple[int, int, CommitRecord | None]]:
        """The newest ``limit`` commits of ``table`` (None: all), newest first. Commits read
        before are not read again: only the versions the cache does not cover are."""
        newest = table.version()
        low = 0 if limit is None else max(0, newest - limit + 1)
        if self._covered is not None and self._covered[0] <= low and self._covered[1] >= low - 1:
            if newest > self._covered[1]:
                fresh = [(c["version"], c["timestamp"], _record(c)) for c in table.history(newest - self._covered[1])]
                self._history = fresh + [e for e in self._history if e[0] <= self._covered[1]]
            self._covered = (self._covered[0], max(newest, self._covered[1]))
        else:
            self._history = [(c["version"], c["timestamp"], _record(c)) for c in table.history(newest - low + 1)]
            self._covered = (low, newest)
        self._history = [e for e in self._history if e[0] >= low]  # a long-lived ledger keeps one window
        self._covered = (low, self._covered[1])
        return [e for e in self._history if e[0] <= newest]

    def recent_commits(self, limit: int | None = 20, table: DeltaTable | None = None) -> list[CommitEntry]:
        """The newest oncemore commits of any pipeline among the last ``limit`` commits (None:
        the whole log), newest first."""
        table = table if table is not None else self.snapshot()
        if table is None:
            return []
        return [CommitEntry(v, t, r) for v, t, r in self._commits(limit, table) if r is not None]

    def recent_batches(self, limit: int | None = 20, table: DeltaTable | None = None) -> list[CommitEntry]:
        """This pipeline's commits on this topic among the last ``limit`` commits, newest first."""
        return [e for e in self.recent_commits(limit, table)
                if e.record.pipeline == self.pipeline and e.record.topic == self.topic]

    def last_commit(self, table: DeltaTable | None = None, limit: int | None = RECENT_HISTORY) -> CommitEntry | None:
        """This pipeline's newest commit within the last ``limit`` commits (None: the whole log)."""
        batches = self.recent_batches(limit, table)
        return batches[0] if batches else None

    def find_commit(self, record: CommitRecord, after_version: int, table: DeltaTable) -> int | None:
        """The version of the commit carrying ``record`` among all versions after ``after_version``
        (a commit of ours is recognised by its record: run ID, batch, ranges and the rest)."""
        for version, _, found in self._commits(table.version() - after_version, table):
            if version > after_version and found == record:
                return version
        return None


def _record(commit: Mapping) -> CommitRecord | None:
    raw = commit.get(METADATA_KEY)
    if raw is None:
        return None
    return CommitRecord.from_json(raw if isinstance(raw, str) else json.dumps(raw))
