"""A pipeline's tables and their positions: where a run starts from, and where each table's share
of what it reads starts.

Every table keeps its own positions (txn actions, ledger.py). A pipeline without ``routes`` plans
from its main table's: the quarantine table commits only where it has rows, so its positions are
only floors (the first offset whose quarantine rows it still needs). A routed pipeline's tables
are all alike: each route table and the quarantine table record every range they consumed (an
empty one too: a commit of positions alone), and the quarantine table commits first, recording the
routes it committed under (RoutesInForce). Each table's share starts at its effective position: a
route table's own position, but never below where its route came into force, and a partition's
next range starts at the lowest effective position (DESIGN.md invariants 3 and 7): a crash between
two tables' commits reruns the tables left behind, and only them.

Where a route came into force: a route the quarantine table's newest commit was not made under
(new, re-added after its removal, or moved to another table) takes the records from the quarantine
table's position on, for the records before were routed (and their unrouted ones quarantined or
counted) by the routes of then; the quarantine commit that brings it into force records that
offset as the route's ``since``, which the route keeps until its table holds a position there, so a
crash before the route table's first commit still starts it there. A partition no table holds a
position for is recorded in all of them before any record of it is read (planner.py's anchor
batch), its ``since`` the anchor's offset.

Invariant: the routes change only while every table of the routes in force holds the quarantine
table's positions (check_routes): the records a table still lacks are never routed again by other
routes, into another table or the quarantine.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Iterable, Mapping

from oncemore.config.model import Pipeline
from oncemore.config.routes import DataTable
from oncemore.core.columns import QUARANTINE_TAG
from oncemore.core.coordinates import KafkaPartition, flat, nested
from oncemore.core.errors import JudgingChanged, RoutesChanged
from oncemore.core.storage import table_key
from oncemore.plan.commitinfo import RoutesInForce
from oncemore.plan.continuity import check_continuity
from oncemore.plan.ledger import RECENT_HISTORY, Ledger, fingerprint

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
        self.pipeline = pipeline
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
        held = {tag: ledger.positions(partitions) for tag, ledger in self.planning().items()}
        return start(self.effective(held), partitions)

    def checked_positions(self, identities, log: Mapping[KafkaPartition, object]) -> dict[KafkaPartition, int | None]:
        """Where the pipeline stands per partition of ``log`` (``positions``), once every planning
        table's own positions pass the checks a run makes before it plans (continuity.py) and the
        routes may change (check_routes)."""
        held = {}
        for tag, ledger in self.planning().items():
            table = ledger.snapshot()
            held[tag] = ledger.positions(log, table)
            check_continuity(self.pipeline, ledger, table, held[tag], identities, log)
        if self.routed:
            self.check_routes(log)
        else:
            self.check_judging(log)
        return start(self.effective(held), log)

    def in_force(self) -> RoutesInForce | None:
        """The routes the quarantine table's newest commit of the pipeline was made under (None: no
        routed commit yet, or none the log still keeps)."""
        return routes_in_force(self.quarantine) if self.routed else None

    def configured(self) -> RoutesInForce:
        """The pipeline file's routes, as a commit records them."""
        routes = self.pipeline.routes
        return RoutesInForce(routes.by, routes.unrouted, {t.route: table_key(t.table_uri) for t, _ in self.data.values()},
                             {t.route: judging(self.pipeline, t) for t, _ in self.data.values()})

    def check_judging(self, partitions: Iterable[KafkaPartition]) -> None:
        """JudgingChanged when, without routes, a part's quarantine commit landed and its main commit
        did not (the quarantine table ahead of the main table) under other settings than the
        pipeline's (``judging``): the rerun would take as rows records it quarantined, or lose the
        ones it now refuses below the quarantine table's floor."""
        partitions = list(partitions)
        main, quarantine = self.main.positions(partitions), self.quarantine.positions(partitions)
        ahead = {p: (main[p], q) for p, q in quarantine.items() if q is not None and (main[p] is None or main[p] < q)}
        table = self.quarantine.snapshot() if ahead else None
        entry = self.quarantine.newest_batch(table) if table is not None else None
        now = judging(self.pipeline, self.pipeline.main)
        if entry is not None and entry.record.judging not in (None, now):
            p, (held, position) = min(ahead.items())
            if held is None:  # the table's first part: it began where the quarantine commit's range does
                held = entry.record.partition_ranges().get(p, (0, position))[0]
            raise JudgingChanged(
                f"pipeline {self.pipeline.name}: topic {p.topic} partition {p.partition} offsets [{held}, {position}) "
                f"were judged into rows and quarantined records by a run that committed the quarantine table's part "
                f"(version {entry.version}) and died before the main table's, and the format, key, transform, "
                "expectations, partition columns or upsert block changed since: restore them and run once, then "
                "change them", pipeline=self.pipeline.name, topic=p.topic, partition=p.partition, start=held,
                end=position, version=entry.version)

    def effective(self, held: Held, found: RoutesInForce | None = None) -> dict[str, dict[KafkaPartition, int | None]]:
        """Per table (tag) of ``held`` (the tables' own positions), the position its share of the
        records starts from: its own, or a route table's never below where its route came into
        force (module docstring). ``found``: the routes in force, read when not given."""
        if not self.routed:
            return {tag: dict(positions) for tag, positions in held.items()}
        found = found or self.in_force()
        quarantine = held[QUARANTINE]
        effective = {QUARANTINE: dict(quarantine)}
        for tag, (table, _) in self.data.items():
            since = _since(found, table) if _entered(found, table, held[tag]) else quarantine
            effective[tag] = {p: _highest(v, since.get(p)) for p, v in held[tag].items()}
        return effective

    def check_routes(self, partitions: Iterable[KafkaPartition]) -> None:
        """RoutesChanged when the pipeline's routes are not the ones in force while a table of those
        lacks records the quarantine table holds the positions of (module docstring's invariant)."""
        found, configured = self.in_force(), self.configured()
        if found is None or found.same_routes(configured):
            return
        ledgers = {table_key(ledger.table_uri): ledger for _, ledger in self.data.values()}
        gap = lagging(found, self.quarantine, ledgers, partitions, self.pipeline.sink.storage_options)
        if gap is not None:
            raise routes_changed(self.pipeline.name, found, configured, gap)

    def routes_record(self, partitions: Iterable[KafkaPartition], starts: Mapping[KafkaPartition, int],
                      found: RoutesInForce | None) -> RoutesInForce:
        """What a part's quarantine commit records (RoutesInForce): the pipeline's routes, and per
        route whose table may still lack the records from where it came into force, that offset
        (its ``since``): carried from the routes in force (``found``, in_force), the quarantine
        table's position for a route coming into force with this commit, or for a partition new to
        the table the offset the part ``starts`` it at. ``partitions``: every partition of the plan."""
        configured = self.configured()
        held = self.held(set(partitions) | set(starts))
        if found is not None and not found.same_routes(configured):
            self.check_routes(list(held[QUARANTINE]))  # another run's routes came into force during this run
        quarantine = held[QUARANTINE]
        since = {}
        for tag, (table, _) in self.data.items():
            own = held[tag]
            carried = dict(_since(found, table)) if _entered(found, table, own) else {
                p: q for p, q in quarantine.items() if q is not None}
            for p, begin in starts.items():
                if carried.get(p) is None and own.get(p) is None:
                    carried[p] = _highest(begin, quarantine.get(p))
            kept = {p: offset for p, offset in carried.items() if own.get(p) is None or own[p] < offset}
            if kept:
                since[table.route] = nested(kept)
        return replace(configured, since=since)


def routes_in_force(quarantine: Ledger) -> RoutesInForce | None:
    """The routes the quarantine table's (``quarantine``'s) newest commit of the pipeline was made
    under (Ledgers.in_force)."""
    table = quarantine.snapshot()
    if table is None:
        return None
    for limit in (1, RECENT_HISTORY, None):  # its newest commit has them, unless another commit came after
        found = next((e.record.routes for e in quarantine.recent_batches(limit, table) if e.record.routes), None)
        if found is not None:
            return found
    return None


def lagging(found: RoutesInForce, quarantine: Ledger, ledgers: Mapping[str, Ledger], partitions: Iterable[KafkaPartition],
            storage_options: Mapping[str, str] | None) -> tuple[str, str, KafkaPartition, int | None, int] | None:
    """The first table of the routes in force ``found`` that lacks records of ``partitions`` the
    quarantine table holds the positions of, as (route, its table, partition, where its share
    starts, the quarantine table's position); None when every one is level. ``ledgers``: the
    ledgers at hand by table_key (another table's is opened)."""
    partitions = list(partitions)
    positions = quarantine.positions(partitions)
    for route, location in sorted(found.tables.items()):
        ledger = ledgers.get(location) or Ledger(location, quarantine.pipeline, storage_options)
        since, own = flat(found.since.get(route, {})), ledger.positions(partitions)
        for p, position in sorted(positions.items()):
            held = _highest(own[p], since.get(p))
            if position is not None and (held is None or held < position):
                return route, location, p, held, position
    return None


def routes_changed(pipeline: str, found: RoutesInForce, configured: RoutesInForce, gap: tuple) -> RoutesChanged:
    """The refusal of ``configured`` routes while a table of the routes in force (``found``) lags
    (``gap``, lagging's), in one line with the way out."""
    route, location, p, held, position = gap
    start_text = f"[{held}, {position})" if held is not None else f"before {position}"
    return RoutesChanged(
        f"pipeline {pipeline}: its routes changed since its last run ({found.changes_to(configured)}) while route "
        f"{route}'s table {location} still lacks topic {p.topic} partition {p.partition} offsets {start_text}: "
        f"restore the routes of the last run ({found.describe()}) and run until every table holds the quarantine "
        "table's positions (status shows none behind), then change them",
        pipeline=pipeline, topic=p.topic, partition=p.partition, start=held, end=position, route=route,
        table_uri=location)


def _entered(found: RoutesInForce | None, table: DataTable, own: Mapping[KafkaPartition, int | None]) -> bool:
    """Whether ``table``'s route is in force, into this table. Without a record of the routes in
    force (none yet, or log cleanup removed the commits that had them after a long pause), a table
    that holds positions is taken for one in force: at worst a route re-added then reads again the
    records quarantined while it was away, never one left without its records."""
    if found is None:
        return any(v is not None for v in own.values())
    return found.tables.get(table.route) == table_key(table.table_uri)


def judging(pipeline: Pipeline, table: DataTable) -> str:
    """A fingerprint of the settings that judge which of ``table``'s records are rows and which are
    quarantined: its format and partition columns, the key's format, the transform, expectations
    and upsert block (never a registry's settings: its secrets)."""
    transform = pipeline.transform
    settings = [_settings(table.format, {"schema_registry"}), _settings(pipeline.key, {"schema_registry"}),
                list(table.partition_by), transform if transform is None or isinstance(transform, str) else _settings(transform),
                [_settings(e) for e in pipeline.expectations], _settings(pipeline.upsert)]
    return f"{fingerprint(json.dumps(settings, sort_keys=True)):x}"


def _settings(model, exclude: set[str] | None = None) -> dict | None:
    """``model``'s settings as set (a default left out: a later version's new setting, at its
    default, judges as before)."""
    return None if model is None else model.model_dump(mode="json", exclude=exclude, exclude_defaults=True)


def _since(found: RoutesInForce, table: DataTable) -> dict[KafkaPartition, int]:
    return flat(found.since.get(table.route, {}))


def _highest(*values: int | None) -> int | None:
    return max((v for v in values if v is not None), default=None)


def start(held: Held, partitions: Iterable[KafkaPartition]) -> dict[KafkaPartition, int | None]:
    """Per partition, the lowest position the ``held`` (the planning tables', effective) hold;
    None where none holds one."""
    found = {}
    for p in partitions:
        values = [positions[p] for positions in held.values() if positions.get(p) is not None]
        found[p] = min(values) if values else None
    return found


def floors(effective: Held, tag: str, starts: Mapping[KafkaPartition, int]) -> dict[KafkaPartition, int]:
    """Per partition of ``starts`` (where a part's ranges start), the first offset table ``tag``
    still needs: its effective position, or the part's start."""
    return {p: _highest(begin, effective[tag].get(p)) for p, begin in starts.items()}
