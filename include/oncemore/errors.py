"""Why a run refuses to go on: typed errors whose message is one line naming the pipeline, the
topic, the partition and the offsets, and whose ``evidence`` carries the same facts for programs.

Each is raised before the run could lose, duplicate or silently skip a record; none is retried
away by oncemore itself.
"""

from __future__ import annotations

from typing import Any


class OncemoreError(RuntimeError):
    """A run cannot honour its contract."""

    def __init__(self, message: str, **evidence: Any):
        super().__init__(message)
        self.evidence = evidence


class PlanError(OncemoreError):
    """The log and the ledger disagree in a way that must not be resolved silently."""


class DataLoss(PlanError):
    """Offsets the pipeline has not ingested are no longer in the log (fail_on_data_loss: true)."""


class TopicChanged(PlanError):
    """The topic the positions refer to is gone: recreated (new topic ID), another cluster, or a
    position beyond the log end."""


class PositionsMissing(PlanError):
    """The table holds data or oncemore commits but no positions for this pipeline and topic."""


class BoundStalled(PlanError):
    """A timestamp bound cannot move past a record stamped after it while older records wait behind it."""


class StalePlan(PlanError):
    """A handed plan does not fit the pipeline or the table's current positions."""


class CommitConflict(OncemoreError):
    """Positions moved while a batch was being written, in a way no retry of this batch can fix."""


class InvalidDataFile(OncemoreError):
    """A written file is not what the commit may reference (missing, wrong schema, offsets outside its range)."""


class UnsupportedTable(OncemoreError):
    """An existing table asks writers for work oncemore does not do (constraints, features)."""
