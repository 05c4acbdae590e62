"""What is left of a planned batch, read from the tables' positions: the next part a run reads
(PartPlan), part after part, until the pipeline's tables hold the whole batch.

Invariant: a part starts where the pipeline stands (tables.py: the main table's position, or for
routes the lowest of its tables' effective ones), never before it, so what every table holds is
never read again; each table's effective position says which of the part's records it already
holds or never takes (its floors: a crash between a part's commits committed them; records before
its route came into force were routed by the routes of then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from oncemore.core.coordinates import KafkaPartition, OffsetRange
from oncemore.plan.planner import Batch
from oncemore.plan.tables import QUARANTINE, Ledgers, floors, start


@dataclass(frozen=True)
class PartPlan:
    """The next part of ``batch``: where the pipeline stands for the batch's partitions
    (``positions``), what is ``left`` of each range from there, and each table's own positions of
    those (``held``, by tag, the quarantine table's included), which its commit builds on, and
    where its share starts (``effective``, tables.Ledgers.effective)."""

    batch: Batch
    positions: Mapping[KafkaPartition, int | None]
    left: Mapping[KafkaPartition, OffsetRange]
    held: Mapping[str, Mapping[KafkaPartition, int | None]]
    effective: Mapping[str, Mapping[KafkaPartition, int | None]]

    def floors(self, tag: str = QUARANTINE) -> dict[KafkaPartition, int]:
        """Per partition left, the first offset table ``tag`` still needs (tables.floors)."""
        return floors(self.effective, tag, {p: r.start for p, r in self.left.items()})


def next_part(batch: Batch, ledgers: Ledgers, where: str) -> PartPlan | None:
    """What is left of ``batch`` at the tables' current positions; None once the tables hold it
    whole. StalePlan when a position lies outside the batch (Batch.remaining)."""
    keys = list(batch.expected_positions)
    planning = {tag: ledger.positions(keys) for tag, ledger in ledgers.planning().items()}
    effective = ledgers.effective(planning)
    positions = start(effective, keys)
    left = batch.remaining(positions, where)
    if not left:
        return None
    held, effective = _within(planning, left), _within(effective, left)
    if not ledgers.routed:
        held[QUARANTINE] = effective[QUARANTINE] = ledgers.quarantine.positions(left)
    return PartPlan(batch, positions, left, held, effective)


def _within(by_tag: Mapping[str, Mapping[KafkaPartition, int | None]], left) -> dict[str, dict]:
    return {tag: {p: v for p, v in found.items() if p in left} for tag, found in by_tag.items()}
