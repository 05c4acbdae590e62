"""The ledger: a pipeline's positions and batch history, kept in the Delta table's own log.

Format (a contract; the CLI, Airflow's report task, the UI and other tools read it):
- a Delta ``txn`` action per partition, appId ``oncemore/<pipeline>/<topic>/<partition>``,
  version = the next offset to read, ``lastUpdated`` = the commit's time. Every oncemore commit
  re-states the position of *every* partition the pipeline holds, moved or not, so that
  ``delta.setTransactionRetentionDuration`` can only expire the positions of a pipeline that
  has not committed for that long (delta-rs drops expired txns when it reads a snapshot);
- beside them, in the same commit, what they refer to and whose they are (``Claims``): per topic
  ``oncemore/<pipeline>/<topic>/@topic_id`` and ``.../@cluster_id``, fingerprints of the IDs, and
  ``oncemore/@owner/<topic>``, the fingerprint of the pipeline that ingests the topic here;
- the commit's commitInfo carries a CommitInfo (plan/commitinfo.py).
Positions and claims come from the snapshot's txn actions (kept by checkpoints), never from a
history scan; reports read recent history, newest first and bounded. History is read from the
commit files themselves (``_delta_log/<version>.json``), version by version: delta-rs's
``history()`` labels the newest commits *on storage* with versions counted down from the
*snapshot's* version, so a commit landing meanwhile (maintenance, another run) shifts every label
(delta-io/delta-rs#4488, still so in 1.6.6) and a commit is looked for under the wrong version.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Mapping

import pyarrow.fs as pafs
from deltalake import DeltaTable, Transaction
from deltalake.exceptions import TableNotFoundError

from oncemore.core.coordinates import KafkaPartition
from oncemore.core.storage import filesystem
from oncemore.plan.commitinfo import METADATA_KEY, CommitEntry, CommitInfo

# Commits read back when looking for this pipeline's newest commit (to name IDs in an error).
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
    """What a snapshot says a topic's positions belong to, as fingerprints (None: not recorded, as
    in tables whose commits predate format 4, which carry their identity only in commit records;
    NO_ID: the broker reported none)."""

    topic_id: int | None
    cluster_id: int | None
    owner: int | None


def open_table(table_uri: str, storage_options: Mapping[str, str] | None = None) -> DeltaTable | None:
    """The table's latest snapshot, or None when no table exists there yet."""
    try:
        return DeltaTable(table_uri, storage_options=dict(storage_options) if storage_options else None)
    except TableNotFoundError:
        return None


class Ledger:
    """Positions, claims and commit history of one pipeline in one Delta table.

    The table's snapshot is loaded once and then brought up to date incrementally (``snapshot()``);
    txn lookups are remembered per snapshot version, and history per commit version, so asking
    the same question twice reads nothing twice (each delta-rs lookup replays the log).
    """

    def __init__(self, table_uri: str, pipeline: str, storage_options: Mapping[str, str] | None = None):
        self.table_uri, self.pipeline = table_uri, pipeline
        self.storage_options = storage_options
        self._table: DeltaTable | None = None
        self._txns: tuple[int, dict[str, int | None]] = (-1, {})  # the lookups of one snapshot version
        # Commit files read, by version: (timestamp, record), or None where no file is left (log
        # cleanup). A version's commit never changes, so what was read is never read again.
        self._read: dict[int, tuple[int, CommitInfo | None, str | None] | None] = {}

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

    def positions(self, partitions: Iterable[KafkaPartition], table: DeltaTable | None = None) -> dict[KafkaPartition, int | None]:
        """Next offset to read per partition; None where nothing was committed yet.

        Pass ``table`` to read the positions of exactly that snapshot (the commit re-check does);
        without it, of the latest snapshot.
        """
        table = table if table is not None else self.snapshot()
        if table is None:
            return {p: None for p in partitions}
        return {p: self._txn(table, app_id(self.pipeline, p.topic, p.partition)) for p in partitions}

    def claims(self, topic: str, table: DeltaTable | None = None) -> Claims:
        """The identity and owner fingerprints of ``topic`` that ``table`` (default: the latest snapshot) holds."""
        table = table if table is not None else self.snapshot()
        if table is None:
            return Claims(None, None, None)
        return Claims(topic_id=self._txn(table, identity_app_id(self.pipeline, topic, "topic_id")),
                      cluster_id=self._txn(table, identity_app_id(self.pipeline, topic, "cluster_id")),
                      owner=self._txn(table, owner_app_id(topic)))

    def transactions(self, new_positions: Mapping[KafkaPartition, int], partitions: Iterable[KafkaPartition],
                     table: DeltaTable, record: CommitInfo) -> list[Transaction]:
        """The txn actions of a commit on ``table``'s snapshot: ``new_positions``, every other of
        ``partitions``' held position re-stated, per topic the topic and cluster the offsets refer
        to (the record's for the topics it is about, else the held ones: a commit stamps no
        identity it did not check) and this pipeline as its owner; all stamped now, so
        none expires while the pipeline runs. A topic of ``partitions`` that the snapshot says
        another pipeline owns (handed over since the caller looked) is left as it is: re-stating
        it would take it back. The caller has checked the owner of ``new_positions``' topics."""
        now_ms = int(time.time() * 1000)
        mine = (None, fingerprint(self.pipeline))
        held = {p: v for p, v in self.positions(set(partitions) - set(new_positions), table).items()
                if v is not None and self.claims(p.topic, table).owner in mine}
        positions = {**held, **new_positions}
        actions = [Transaction(app_id(self.pipeline, p.topic, p.partition), v, now_ms) for p, v in sorted(positions.items())]
        for topic in sorted({p.topic for p in positions}):
            claims = self.claims(topic, table)
            about = topic in record.topic_ids  # a topic the commit read (or reset): checked against the broker
            for what, stated, kept in (("topic_id", record.topic_ids.get(topic), claims.topic_id),
                                       ("cluster_id", record.cluster_id if about else None, claims.cluster_id)):
                value = fingerprint(stated) if stated else kept if kept is not None else NO_ID if about else None
                if value is not None:
                    actions.append(Transaction(identity_app_id(self.pipeline, topic, what), value, now_ms))
            actions.append(Transaction(owner_app_id(topic), fingerprint(self.pipeline), now_ms))
        return actions

    @cached_property
    def _log_store(self) -> tuple[pafs.FileSystem, str]:
        """The filesystem and root the commit files are read from (an S3 client is built once)."""
        return filesystem(self.table_uri, self.storage_options)

    def _commits(self, limit: int | None, table: DeltaTable) -> list[tuple[int, int, CommitInfo | None, str | None]]:
        """The newest ``limit`` commits of ``table`` (None: all), newest first, as (version,
        timestamp, record, the operation if it removed data rows). Only versions not read before are read."""
        newest = table.version()
        fs, root = self._log_store
        if limit is None:  # the whole log: the versions whose commit files are still there
            versions = self.kept_versions(table)[::-1]
        else:
            versions = list(range(newest, max(-1, newest - limit), -1))
        unread = [v for v in versions if v not in self._read]
        if unread:
            with ThreadPoolExecutor(max_workers=min(16, len(unread))) as pool:
                self._read.update(zip(unread, pool.map(lambda v: _read_commit(fs, root, v), unread)))
        low = versions[-1] if versions else 0
        self._read = {v: e for v, e in self._read.items() if v >= low}  # a long-lived ledger keeps one window
        return [(v, *self._read[v]) for v in versions if self._read[v] is not None]

    def kept_versions(self, table: DeltaTable) -> list[int]:
        """The versions up to ``table``'s whose commit files the log still keeps (log cleanup
        removes the oldest), oldest first."""
        fs, root = self._log_store
        listed = fs.get_file_info(pafs.FileSelector(f"{root}/_delta_log"))
        return sorted(v for v in (int(i.base_name[:-5]) for i in listed
                                  if i.base_name.endswith(".json") and i.base_name[:-5].isdigit())
                      if v <= table.version())

    def recent_commits(self, limit: int | None = 20, table: DeltaTable | None = None) -> list[CommitEntry]:
        """The newest oncemore commits of any pipeline among the last ``limit`` commits (None:
        the whole log), newest first."""
        table = table if table is not None else self.snapshot()
        if table is None:
            return []
        return [CommitEntry(v, t, r) for v, t, r, _ in self._commits(limit, table) if r is not None]

    def rows_removed_outside(self, table: DeltaTable) -> list[tuple[int, str]]:
        """The kept commits that removed data rows and carry no oncemore record (another writer's
        DELETE, UPDATE, MERGE or overwrite), as (version, operation), oldest first."""
        return sorted((v, removed) for v, _, r, removed in self._commits(None, table) if r is None and removed)

    def recent_batches(self, limit: int | None = 20, table: DeltaTable | None = None) -> list[CommitEntry]:
        """This pipeline's commits among the last ``limit`` commits, newest first."""
        return [e for e in self.recent_commits(limit, table) if e.record.pipeline == self.pipeline]

    def last_commit(self, topic: str, table: DeltaTable | None = None, limit: int | None = RECENT_HISTORY) -> CommitEntry | None:
        """This pipeline's newest commit on ``topic`` within the last ``limit`` commits (None: the whole log)."""
        return next((e for e in self.recent_batches(limit, table) if topic in e.record.topics), None)

    def newest_batch(self, table: DeltaTable) -> CommitEntry | None:
        """This pipeline's newest commit: in recent history, else searched through the whole log
        (a table busy with other pipelines' commits)."""
        return next(iter(self.recent_batches(RECENT_HISTORY, table) or self.recent_batches(None, table)), None)

    def stated_positions(self, version: int) -> dict[KafkaPartition, int]:
        """The positions of this pipeline that commit ``version`` stated in its txn actions (an
        oncemore commit states every position the pipeline holds, on any topic); {} when the log
        no longer keeps its file."""
        fs, root = self._log_store
        prefix = f"oncemore/{self.pipeline}/"
        try:
            with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as stream:
                lines = stream.read().splitlines()
        except FileNotFoundError:
            return {}
        stated = {}
        for txn in (json.loads(line).get("txn") for line in filter(None, lines)):
            if txn and txn["appId"].startswith(prefix):
                topic, _, partition = txn["appId"][len(prefix):].rpartition("/")
                if partition.isdigit():  # not an identity claim (.../@topic_id)
                    stated[KafkaPartition(topic, int(partition))] = txn["version"]
        return stated

    def find_commit(self, record: CommitInfo, after_version: int, table: DeltaTable) -> int | None:
        """The version of the commit carrying ``record`` among all versions after ``after_version``
        (a commit of ours is recognised by its record: run ID, batch, ranges and the rest)."""
        for version, _, found, _ in self._commits(table.version() - after_version, table):
            if version > after_version and found is not None and found.to_json() == record.to_json():
                return version
        return None


def _read_commit(fs: pafs.FileSystem, root: str, version: int) -> tuple[int, CommitInfo | None, str | None] | None:
    """The timestamp and oncemore record of one commit file, and its operation when it removed data
    rows (a ``remove`` with dataChange: not compaction's); None when the file is gone."""
    try:
        with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as stream:
            lines = stream.read().splitlines()
    except FileNotFoundError:
        return None
    timestamp, record, operation, removes = 0, None, "unknown", False
    for action in map(json.loads, filter(None, lines)):
        if "commitInfo" in action:
            info = action["commitInfo"]
            raw = info.get(METADATA_KEY)
            record = None if raw is None else CommitInfo.from_json(raw if isinstance(raw, str) else json.dumps(raw))
            timestamp, operation = int(info.get("timestamp", 0)), info.get("operation", "unknown")
        elif "remove" in action and action["remove"].get("dataChange", True):
            removes = True
    return timestamp, record, operation if removes else None
