"""What is left of a planned batch, read from both tables' positions: the next part a run reads
(PartPlan), part after part, until the main table holds the whole batch.

Invariant: a part starts at the main table's position, never before it, so what the table holds is
never read again; the quarantine table's own positions say which of its rows a crash between a
part's two commits already committed (its floors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from oncemore.core.coordinates import KafkaPartition, OffsetRange
from oncemore.plan.ledger import Ledger
from oncemore.plan.planner import Batch


@dataclass(frozen=True)
class PartPlan:
    """The next part of ``batch``: the main table's ``positions`` of the batch's partitions, what
    is ``left`` of each range from there, and the quarantine table's positions of those."""

    batch: Batch
    positions: Mapping[KafkaPartition, int | None]
    left: Mapping[KafkaPartition, OffsetRange]
    quarantine_positions: Mapping[KafkaPartition, int | None]

    def floors(self) -> dict[KafkaPartition, int]:
        """Per partition left, the first offset the quarantine table still needs."""
        return {p: max(r.start, self.quarantine_positions[p] or 0) for p, r in self.left.items()}


def next_part(batch: Batch, main: Ledger, quarantine: Ledger, where: str) -> PartPlan | None:
    """What is left of ``batch`` at the tables' current positions; None once the main table holds
    it whole. StalePlan when a position lies outside the batch (Batch.remaining)."""
    positions = main.positions(batch.expected_positions)
    left = batch.remaining(positions, where)
    if not left:
        return None
    return PartPlan(batch, positions, left, quarantine.positions(left))
