"""What a run did, as the run returns it to its caller (the CLI's last line, the Airflow task's XCom):
per batch, whether one of its commits was this run's, the records written and quarantined (for an
upsert, what its events did: inserted, updated, deleted, stale, ...), the table versions it made,
and whether it committed more quarantine than the pipeline's limit because the run accepted it; and
what a run that was interrupted had committed, read back from the table (``committed_by``).

Invariant: a run is "committed" only when a commit of its own landed; a run that found its plan
already held is a "no-op", whatever another run committed meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oncemore.commit.merge import describe_counts
from oncemore.config.model import Pipeline
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.ledger import Ledger
from oncemore.plan.planner import Plan

# Commits read back to count what an interrupted run had committed.
RECENT_RUN_COMMITS = 1000


@dataclass
class BatchReport:
    seq: int
    ranges: dict[KafkaPartition, tuple[int, int]]
    status: str = "already_committed"  # "committed" once one of its commits is ours
    written: int = 0
    quarantined: int = 0
    events: dict[str, int] | None = None  # an upsert's counts (merge.COUNTS and the others), summed over its parts
    versions: list[int] = field(default_factory=list)
    quarantine_versions: list[int] = field(default_factory=list)
    quarantine_accepted: bool = False  # a commit of it was over the quarantine limit (--accept-quarantine)


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
        accepted = [str(b.seq) for b in self.batches if b.quarantine_accepted]
        over = f" (batch {', '.join(accepted)} over the quarantine limit, accepted)" if accepted else ""
        return (f"{self.pipeline}: committed {len(committed)} batch(es), {done}{over}, table version "
                f"{max(committed[-1].versions)}, in {self.seconds:.1f}s")


def committed_by(pipeline: Pipeline, run_id: str) -> str:
    """What run ``run_id`` had committed, from the table (a batch's commit is whole or absent)."""
    commits = [e for e in Ledger(pipeline.sink.table_uri, pipeline.name, pipeline.sink.storage_options
                                 ).recent_batches(RECENT_RUN_COMMITS) if e.record.run_id == run_id]
    if not commits:
        return f"pipeline {pipeline.name}: run {run_id} had committed nothing"
    return (f"pipeline {pipeline.name}: run {run_id} had committed {len({e.record.batch_seq for e in commits})} "
            f"batch(es), table version {max(e.version for e in commits)}")
