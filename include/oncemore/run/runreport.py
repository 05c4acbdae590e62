"""What a run did, as the run returns it to its caller (the CLI's last line and ``--report-file``, the
Airflow ingest task's XCom and lineage): per batch, whether one of its commits was this run's, the
ranges its own commits moved the positions over, the records written and quarantined (for an
upsert, what its events did: inserted, updated, deleted, stale, ...), what its commits added to
each table (rows, bytes, files), the table versions it made, and whether it committed more
quarantine than the pipeline's limit because the run accepted it; and what a run that was
interrupted had committed, read back from the table (``committed_by``).

Invariant: a run is "committed" only when a commit of its own landed; a run that found its plan
already held is a "no-op", whatever another run committed meanwhile. Only this run's own commits
count in ``committed`` and ``added``. The JSON carries no Kafka address or setting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from oncemore.commit.merge import describe_counts
from oncemore.config.model import Pipeline
from oncemore.core.columns import ROUTE_TAG_PREFIX
from oncemore.core.coordinates import KafkaPartition, flat, nested
from oncemore.plan.planner import Plan
from oncemore.plan.tables import Ledgers

# Commits read back to count what an interrupted run had committed.
RECENT_RUN_COMMITS = 1000


@dataclass
class BatchReport:
    seq: int
    ranges: dict[KafkaPartition, tuple[int, int]]
    status: str = "already_committed"  # "committed" once one of its commits is ours
    written: int = 0
    quarantined: int = 0
    unrouted: int = 0  # routes.unrouted: skip
    events: dict[str, int] | None = None  # an upsert's counts (merge.COUNTS and the others), summed over its parts
    versions: list[int] = field(default_factory=list)
    quarantine_versions: list[int] = field(default_factory=list)
    table_versions: dict[str, int] = field(default_factory=dict)  # with routes: by tag, the newest this batch made
    quarantine_accepted: bool = False  # a commit of it was over the quarantine limit (--accept-quarantine)
    committed: dict[KafkaPartition, tuple[int, int]] = field(default_factory=dict)  # [start, end) our commits moved
    added: dict[str, dict[str, int]] = field(default_factory=dict)  # {table: {rows, bytes, files}} our commits added

    def account(self, read: dict[KafkaPartition, tuple[int, int]], added: dict[str, dict[str, int]]) -> None:
        """A part of this batch committed by this run: the ranges it moved and what it added."""
        for key, (start, end) in read.items():
            if end > start:
                first, _ = self.committed.get(key, (start, end))
                self.committed[key] = (min(first, start), end)
        for table, counts in added.items():
            into = self.added.setdefault(table, {})
            for name, count in counts.items():
                into[name] = into.get(name, 0) + count

    def to_dict(self) -> dict:
        data = asdict(self)
        data["ranges"] = nested({k: list(v) for k, v in self.ranges.items()})
        data["committed"] = nested({k: list(v) for k, v in self.committed.items()})
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "BatchReport":
        ranges = {k: tuple(v) for k, v in flat(data["ranges"]).items()}
        committed = {k: tuple(v) for k, v in flat(data["committed"]).items()}
        return cls(**{**data, "ranges": ranges, "committed": committed})


@dataclass
class RunReport:
    pipeline: str
    run_id: str
    plan: Plan
    batches: list[BatchReport] = field(default_factory=list)
    seconds: float = 0.0
    profile: dict[str, int] = field(default_factory=dict)  # {phase: ms} (core/stopwatch.py)

    @property
    def status(self) -> str:
        return "committed" if any(b.status == "committed" for b in self.batches) else "no-op"

    @property
    def written(self) -> int:
        return sum(b.written for b in self.batches)

    @property
    def quarantined(self) -> int:
        return sum(b.quarantined for b in self.batches)

    @property
    def committed(self) -> dict[KafkaPartition, tuple[int, int]]:
        """Per partition, the [start, end) this run's commits moved the positions over."""
        ranges: dict[KafkaPartition, tuple[int, int]] = {}
        for batch in self.batches:
            for key, (start, end) in batch.committed.items():
                ranges[key] = (min(start, ranges.get(key, (start, end))[0]), end)
        return ranges

    @property
    def added(self) -> dict[str, dict[str, int]]:
        """What this run's commits added to each table: {table: {rows, bytes, files}}."""
        total = BatchReport(-1, {})
        for batch in self.batches:
            total.account({}, batch.added)
        return total.added

    @property
    def committed_versions(self) -> dict[str, int | None]:
        """The newest version of each table a commit of this run made (None: none), by table: "main"
        and "quarantine", and with routes each route's table ("route:<value>")."""
        main = [v for b in self.batches for v in b.versions]
        quarantine = [v for b in self.batches for v in b.quarantine_versions]
        made: dict[str, int | None] = {"main": max(main, default=None), "quarantine": max(quarantine, default=None)}
        for batch in self.batches:
            for tag, version in batch.table_versions.items():
                made[tag] = max(version, made.get(tag) or version)
        return made

    def to_json(self) -> str:
        """The report without its plan (the caller that handed the plan has it)."""
        return json.dumps({"pipeline": self.pipeline, "run_id": self.run_id, "status": self.status,
                           "batches": [b.to_dict() for b in self.batches], "seconds": round(self.seconds, 3),
                           "profile": self.profile}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, plan: Plan) -> "RunReport":
        data = json.loads(text)
        return cls(data["pipeline"], data["run_id"], plan, [BatchReport.from_dict(b) for b in data["batches"]],
                   data["seconds"], data["profile"])

    def summary(self) -> str:
        if self.status == "no-op":
            why = "nothing new to ingest" if self.plan.is_empty else "the table already holds this plan"
            return f"{self.pipeline}: no-op ({why}) in {self.seconds:.1f}s"
        committed = [b for b in self.batches if b.status == "committed"]
        if any(b.events is not None for b in committed):
            events: dict[str, int] = {}
            for batch in committed:
                for name, count in (batch.events or {}).items():
                    events[name] = events.get(name, 0) + count
            done = describe_counts({**events, "quarantined": self.quarantined})
        else:
            done = f"{self.written} records written, {self.quarantined} quarantined"
            unrouted = sum(b.unrouted for b in self.batches)
            done += f", {unrouted} unrouted (skipped)" if unrouted else ""
        accepted = [str(b.seq) for b in self.batches if b.quarantine_accepted]
        over = f" (batch {', '.join(accepted)} over the quarantine limit, accepted)" if accepted else ""
        versions = {tag: v for b in committed for tag, v in b.table_versions.items()}
        if versions:  # routes: each table's newest version this run made
            where = "table versions " + ", ".join(f"{tag.removeprefix(ROUTE_TAG_PREFIX)} {v}"
                                                  for tag, v in sorted(versions.items()))
        else:
            where = f"table version {max(committed[-1].versions)}"
        return f"{self.pipeline}: committed {len(committed)} batch(es), {done}{over}, {where}, in {self.seconds:.1f}s"


def committed_by(pipeline: Pipeline, run_id: str) -> str:
    """What run ``run_id`` had committed, from the tables (a table's commit is whole or absent)."""
    ledgers = Ledgers(pipeline)
    found = {tag: [e for e in ledger.recent_batches(RECENT_RUN_COMMITS) if e.record.run_id == run_id]
             for tag, ledger in ledgers.planning().items()}
    commits = [e for entries in found.values() for e in entries]
    if not commits:
        return f"pipeline {pipeline.name}: run {run_id} had committed nothing"
    versions = (f"table version {max(e.version for e in commits)}" if not ledgers.routed else "table versions " +
                ", ".join(f"{tag.removeprefix(ROUTE_TAG_PREFIX)} {max(e.version for e in entries)}"
                          for tag, entries in found.items() if entries))
    return (f"pipeline {pipeline.name}: run {run_id} had committed {len({e.record.batch_seq for e in commits})} "
            f"batch(es), {versions}")
