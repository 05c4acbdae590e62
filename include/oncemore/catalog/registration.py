"""Registers a pipeline's tables in its catalog (``sink.catalog``) after the run's commits, and says
whether they are registered (``status``, the page, ``check``).

Invariants (DESIGN.md 8): registration follows the commits and never gates them; the data is in
the tables whatever happens here. It is idempotent and derived from the tables alone: each entry
(catalog/entries.py) is compared with what the catalog holds and only what differs is written (a
run whose tables are registered as they are writes nothing), so a failure is made good by the next
run, a no-op one included, with no state kept in between. It re-points or renames nothing: a name
held at another location, or the location held under another name (in the same database), is a
CatalogConflict naming both, for a person to resolve.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from oncemore.catalog.entries import Entry, entries, same_location
from oncemore.config.catalog import HiveCatalog
from oncemore.config.model import Pipeline
from oncemore.core.errors import CatalogConflict, CatalogError

log = logging.getLogger("oncemore")


@dataclass(frozen=True)
class Assessment:
    """How an entry stands in the catalog: "registered" (as it should be), "missing" or "outdated"
    (its columns or parameters differ: the next registration updates them)."""

    entry: Entry
    state: str


def register(pipeline: Pipeline) -> list[str]:
    """Registers the pipeline's existing tables; returns what it did, one line per table written
    (none when all were registered). Raises CatalogError (a CatalogConflict for a conflict), naming
    the catalog and its error."""
    catalog = pipeline.sink.catalog
    done = []
    with _failures(pipeline, "registering the tables"):
        wanted = entries(pipeline)
        with connect(pipeline) as client:
            for entry in wanted:
                assessment = _assess(client, pipeline, entry)
                if assessment.state == "missing":
                    client.create_database(entry.database)
                    if not client.create(entry, pipeline.name):  # another run's registration came first
                        assessment = _assess(client, pipeline, entry)
                    else:
                        done.append(f"registered {entry.qualified} at {entry.location}")
                if assessment.state == "outdated":
                    client.update(entry, pipeline.name)
                    done.append(f"updated {entry.qualified}'s columns ({len(entry.columns)})")
    for line in done:
        log.info("pipeline %s: catalog %s: %s", pipeline.name, catalog.describe(), line)
    return done


def catalog_state(pipeline: Pipeline) -> dict[str, Any]:
    """Whether the pipeline's tables are registered as they should be, read from the catalog
    (nothing is written): ``registered``, the ``reason`` when not and whether it is ``blocked`` (a
    conflict or a catalog that does not answer, which no run gets past as it is), the ``tables`` by
    name and how each stands, and the ``summary`` line status and the page show: "catalog:
    registered as ..." or "catalog: not registered (reason)"."""
    catalog = pipeline.sink.catalog
    state: dict[str, Any] = {"catalog": catalog.describe(), "registered": False, "reason": None, "tables": {}}
    assessed: list[Assessment] = []
    try:
        wanted = entries(pipeline)
    except Exception as exc:  # a table's log that cannot be read (status and check say so on their own)
        wanted, state["reason"] = [], f"the tables could not be read: {_cause(exc)}"
    try:
        with connect(pipeline) as client:
            assessed = [_assess(client, pipeline, entry) for entry in wanted]
            if not wanted:  # asked all the same: whether it answers is worth knowing before the first run
                client.get(catalog.database, catalog.table)
    except CatalogConflict as exc:
        state["reason"] = str(exc)
    except Exception as exc:  # the catalog did not answer, or refused
        state["reason"] = state["reason"] or f"the catalog did not answer: {_cause(exc)}"
    state["blocked"] = state["reason"] is not None  # a conflict, or no answer: no run registers them as it is
    state["tables"] = {a.entry.qualified: a.state for a in assessed}
    behind = [a for a in assessed if a.state != "registered"]
    if state["reason"] is None and not assessed:
        state["reason"] = "no table yet: the first commit creates the tables, and its run registers them"
    elif behind:
        state["reason"] = "; ".join(f"{a.entry.qualified} is {_STATES[a.state]}" for a in behind) + \
                          " (the next run registers it)"
    state["registered"] = state["reason"] is None
    state["summary"] = (f"catalog: registered as {', '.join(state['tables'])} ({state['catalog']})"
                        if state["registered"] else f"catalog: not registered ({state['reason']})")
    return state


_STATES = {"missing": "not in the catalog", "outdated": "registered with other columns than the table's"}


def connect(pipeline: Pipeline):
    """A client of the pipeline's catalog (a context manager)."""
    catalog = pipeline.sink.catalog
    if isinstance(catalog, HiveCatalog):
        from oncemore.catalog.hive import HiveMetastore

        return HiveMetastore(catalog.uri)
    from oncemore.catalog.glue import GlueCatalog

    return GlueCatalog()


def _assess(client, pipeline: Pipeline, entry: Entry) -> Assessment:
    """How ``entry`` stands; CatalogConflict when its name is at another location, or its
    location under another name."""
    where = f"pipeline {pipeline.name}: catalog {pipeline.sink.catalog.describe()}"
    held = client.get(entry.database, entry.name)
    if held is None:
        other = client.name_at(entry.database, entry.location, same_location)
        if other is not None:
            raise CatalogConflict(
                f"{where}: the {entry.role}'s location {entry.location} is registered as {entry.database}.{other}: "
                f"refusing to register it again as {entry.qualified} (drop {entry.database}.{other} from the catalog, "
                f"or name it in sink.catalog.table)", catalog=pipeline.sink.catalog.describe(), name=entry.qualified,
                location=entry.location, registered_as=f"{entry.database}.{other}")
        return Assessment(entry, "missing")
    if not same_location(held.location, entry.location):
        raise CatalogConflict(
            f"{where}: {entry.qualified} is registered at {held.location}, not at the {entry.role}'s location "
            f"{entry.location}: refusing to re-point it (drop or rename {entry.qualified} in the catalog, or name "
            "another table in sink.catalog.table)", catalog=pipeline.sink.catalog.describe(), name=entry.qualified,
            location=entry.location, registered_at=held.location)
    return Assessment(entry, "registered" if held.matches(entry) else "outdated")


@contextmanager
def _failures(pipeline: Pipeline, doing: str) -> Iterator[None]:
    """Turns what goes wrong while ``doing`` into a one-line CatalogError naming the catalog."""
    try:
        yield
    except CatalogError:
        raise
    except Exception as exc:
        catalog = pipeline.sink.catalog
        raise CatalogError(f"pipeline {pipeline.name}: catalog {catalog.describe()}: {doing} failed: {_cause(exc)}",
                           catalog=catalog.describe(), cause=_cause(exc)) from exc


def _cause(exc: BaseException) -> str:
    """The catalog's error in one line, named by its type (Thrift's MetaException and friends keep
    their text in ``message``; boto's and sockets' errors in their str)."""
    text = str(getattr(exc, "message", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
