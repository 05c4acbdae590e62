"""Whether a run landed: the table's positions (with routes, every table's) reach every end it
planned, and what its own commits wrote, for the Airflow task that reports a run (a run that
reports success must be in the log).

Invariant: a plan the table does not hold fails with RunNotCommitted naming each short partition,
its position and its planned end, even when the run's own process said it committed.
"""

from __future__ import annotations

from typing import Any

from oncemore.config.model import Pipeline
from oncemore.core.errors import OncemoreError
from oncemore.plan.tables import Ledgers
from oncemore.plan.planner import Plan
from oncemore.report.status import status


class RunNotCommitted(OncemoreError):
    """The table's positions do not cover what the run planned."""


def run_landed(pipeline: Pipeline, plan: Plan, run_id: str) -> dict[str, Any]:
    """Checks that the table's positions reach every planned end and sums what ``run_id`` committed.

    Raises RunNotCommitted otherwise: a run that reports success must have its commits in the log
    (or find that another run committed the same range)."""
    ledgers = Ledgers(pipeline)
    planned_ends = plan.ends()
    positions = ledgers.positions(planned_ends)  # with routes, the lowest of its tables'
    short = {p: (positions[p], end) for p, end in planned_ends.items() if positions[p] is None or positions[p] < end}
    if short:
        detail = ", ".join(f"{p}: position {pos}, planned end {end}" for p, (pos, end) in sorted(short.items()))
        raise RunNotCommitted(f"pipeline {pipeline.name}: run {run_id} planned ranges the tables do not hold ({detail})",
                              pipeline=pipeline.name, short={str(p): v for p, v in short.items()})
    # A batch cut by byte budgets takes several commits; look back far enough for all of them.
    commits = [e for ledger in ledgers.planning().values()
               for e in ledger.recent_batches(limit=4 * len(plan.batches) + 50) if e.record.run_id == run_id]
    return {
        "pipeline": pipeline.name,
        "run_id": run_id,
        "status": "committed" if commits else "no-op",
        "commits": sorted(e.version for e in commits),
        "records": {name: sum(e.record.records.get(name, 0) for e in commits)
                    for name in ("written", "quarantined", "filtered", *(("unrouted",) if ledgers.routed else ()))},
        "partitions": status(pipeline)["partitions"],
    }
