"""The ledger: a pipeline's positions and batch history, kept in the Delta table's own log.

Format (a contract; the CLI, Airflow's report task and other tools read it):
- one Delta ``txn`` action per partition touched by a data commit, appId
  ``oncemore/<pipeline>/<topic>/<partition>``, version = the next offset to read;
- the commit's commitInfo carries the batch description as JSON under the key ``oncemore``.
Positions come from the snapshot's txn actions (kept by checkpoints), never from a history scan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from . import __version__

METADATA_KEY = "oncemore"
FORMAT_VERSION = 1


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
class BatchRecord:
    """The description of one committed batch, as stored in the commit's metadata."""

    pipeline: str
    batch_seq: int
    run_id: str
    until: str | None
    ranges: Mapping[str, Mapping[str, list[int]]]  # {topic: {partition: [start, end]}}
    records: Mapping[str, int]  # {"written": n, "quarantined": n}
    gaps: list[Gap] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    oncemore_version: str = __version__

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BatchRecord":
        data = json.loads(text)
        data["gaps"] = [Gap(**g) for g in data.get("gaps", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class CommitEntry:
    version: int
    timestamp_ms: int
    batch: BatchRecord


def open_table(table_uri: str) -> DeltaTable | None:
    """The table's latest snapshot, or None when no table exists there yet."""
    try:
        return DeltaTable(table_uri)
    except TableNotFoundError:
        return None


class Ledger:
    """Positions and batch history of one pipeline in one Delta table."""

    def __init__(self, table_uri: str, pipeline: str, topic: str):
        self.table_uri, self.pipeline, self.topic = table_uri, pipeline, topic

    def committed_positions(
        self, partitions: Iterable[int], table: DeltaTable | None = None
    ) -> dict[int, int | None]:
        """Next offset to read per partition; None where nothing was committed yet.

        Pass ``table`` to read the positions of exactly that snapshot (the commit re-check does).
        """
        table = table if table is not None else open_table(self.table_uri)
        if table is None:
            return {p: None for p in partitions}
        return {p: table.transaction_version(app_id(self.pipeline, self.topic, p)) for p in partitions}

    def recent_batches(self, limit: int = 20) -> list[CommitEntry]:
        """The newest oncemore commits, newest first (reads ``limit`` commits of history)."""
        table = open_table(self.table_uri)
        if table is None:
            return []
        entries = []
        for commit in table.history(limit):
            raw = commit.get(METADATA_KEY)
            if raw is None:
                continue
            batch = BatchRecord.from_json(raw if isinstance(raw, str) else json.dumps(raw))
            if batch.pipeline == self.pipeline:
                entries.append(CommitEntry(commit["version"], commit["timestamp"], batch))
        return entries
