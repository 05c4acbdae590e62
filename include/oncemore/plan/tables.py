"""A pipeline's tables and their positions: where a run starts from, and where each table's share
of what it reads starts.

Every table keeps its own positions (txn actions, ledger.py). A pipeline without ``routes`` plans
from its main table's: the quarantine table commits only where it has rows, so its positions are
only floors (the first offset whose quarantine rows it still needs). A routed pipeline's tables
are all alike: each route table and the quarantine table record every range they consumed (an
empty one too: a commit of positions alone), so a partition's next range starts at the lowest
position any of them holds, and each table takes only the records at or after its own position
(DESIGN.md invariants 3 and 7): a crash between two tables' commits reruns the tables left behind,
and only them.

A routed table that holds no position for a partition another of the pipeline's tables holds one
for was added to the pipeline since (a new route): it starts at the quarantine table's position,
where the records before it were routed (and their unrouted ones quarantined or counted) by the
routes of then; without one, at the lowest position held. A partition no table holds a position
for is recorded in all of them before any record of it is read (planner.py's anchor batch), so a
crash between the first commits never leaves a table to be taken for new.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from oncemore.config.model import Pipeline
from oncemore.config.routes import DataTable
from oncemore.core.columns import QUARANTINE_TAG
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.ledger import Ledger

QUARANTINE = QUARANTINE_TAG  # the quarantine table's tag (DataTable.tag names the others)

Held = Mapping[str, Mapping[KafkaPartition, int | None]]  # {tag: {partition: position}}


def plan_table_uri(pipeline: Pipeline) -> str:
    """The table a plan names: the main table, or for routes the quarantine table, which every
    routed part commits to."""
    return pipeline.sink.table_uri if pipeline.routes is None else pipeline.sink.quarantine_uri


class Ledgers:
    """The ledgers of a pipeline's tables: its data tables' (``DataTable.tag``) and the quarantine table's."""

    def __init__(self, pipeline: Pipeline):
        options = pipeline.sink.storage_options
        self.routed = pipeline.routes is not None
        self.data: dict[str, tuple[DataTable, Ledger]] = {
            t.tag: (t, Ledger(t.table_uri, pipeline.name, options)) for t in pipeline.tables}
        self.quarantine = Ledger(pipeline.sink.quarantine_uri, pipeline.name, options)

    @property
    def main(self) -> Ledger:
        """The one data table's ledger of a pipeline without routes."""
        assert not self.routed, "a routed pipeline has a ledger per route"
        return self.data["main"][1]

    def by_tag(self) -> dict[str, Ledger]:
        """Every table's ledger by tag, the data tables first, in the pipeline's order."""
        return {**{tag: ledger for tag, (_, ledger) in self.data.items()}, QUARANTINE: self.quarantine}

    def planning(self) -> dict[str, Ledger]:
        """The ledgers whose positions a run plans from: the main table's, or every table's of a routed pipeline."""
        return self.by_tag() if self.routed else {"main": self.main}

    def held(self, partitions: Iterable[KafkaPartition]) -> dict[str, dict[KafkaPartition, int | None]]:
        """Each table's own positions of ``partitions``, by tag (its latest snapshot)."""
        partitions = list(partitions)
        return {tag: ledger.positions(partitions) for tag, ledger in self.by_tag().items()}

    def positions(self, partitions: Iterable[KafkaPartition]) -> dict[KafkaPartition, int | None]:
        """Where the pipeline stands per partition: the positions a run plans from (``start``)."""
        partitions = list(partitions)
        return start({tag: ledger.positions(partitions) for tag, ledger in self.planning().items()}, partitions)


def start(held: Held, partitions: Iterable[KafkaPartition]) -> dict[KafkaPartition, int | None]:
    """Per partition, the lowest position the ``held`` (the planning tables') hold; None where none
    holds one."""
    found = {}
    for p in partitions:
        values = [positions[p] for positions in held.values() if positions.get(p) is not None]
        found[p] = min(values) if values else None
    return found


def floors(held: Held, routed: bool, tag: str, starts: Mapping[KafkaPartition, int]) -> dict[KafkaPartition, int]:
    """Per partition of ``starts`` (where a part's ranges start), the first offset table ``tag``
    still needs: its own position; without one, the part's start, or for a routed pipeline whose
    other tables hold positions, the quarantine table's (module docstring)."""
    own = held[tag]
    found = {}
    for p, begin in starts.items():
        position = own.get(p)
        if position is None and routed:
            position = held[QUARANTINE].get(p)
        found[p] = max(begin, position if position is not None else begin)
    return found
