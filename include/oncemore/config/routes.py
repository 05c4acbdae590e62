"""The ``routes`` block of a pipeline file: one topic into several tables, each record into the
table its ``by`` value names, and the tables a pipeline writes (``DataTable``) with or without it.

Its shape is a contract (tools outside the project write it):
``routes: {by: value.type | headers['event_type'] | key, tables: {<value>: {table_uri, format}},
unrouted: quarantine | skip}``; with it, the pipeline has no top-level ``format`` nor
``sink.table_uri``, and ``sink.quarantine_uri`` is the one quarantine of every route.

``by`` is read from the record as it arrives, before any decoding (each route decodes with its own
format): ``value.<field>[.<field>...]``, a field of a JSON value (a JSON string; of its ``payload``
when the routes' values come wrapped by Kafka Connect's JsonConverter, ``schemas_enable``); ``headers['name']``,
the record's last header of that name (Kafka's ``Headers.lastHeader``), as UTF-8; ``key``, the
whole key as UTF-8. decode/routing.py evaluates it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field, StrictStr, field_validator, model_validator

from oncemore.config.catalog import route_name_problem
from oncemore.config.formats import Format
from oncemore.config.values import ConfigModel, key_problem
from oncemore.core.columns import MAIN_TAG, ROUTE_TAG_PREFIX
from oncemore.core.storage import same_table, table_key

if TYPE_CHECKING:
    from oncemore.config.model import Pipeline

# The forms of ``by``: value.a.b (JSON field names without dots, quotes or brackets), headers['x'], key.
_VALUE_PATH = re.compile(r"^value((?:\.[^.\s\[\]'\"]+)+)$")
_HEADER = re.compile(r"""^headers\[(?:'([^']+)'|"([^"]+)")\]$""")


@dataclass(frozen=True)
class RouteBy:
    """``routes.by`` parsed: ``kind`` value (``path``: the JSON field names), header (``name``) or key."""

    kind: Literal["value", "header", "key"]
    path: tuple[str, ...] = ()
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "RouteBy":
        text = text.strip()
        if text == "key":
            return cls("key")
        found = _VALUE_PATH.match(text)
        if found:
            return cls("value", tuple(found.group(1)[1:].split(".")))
        found = _HEADER.match(text)
        if found:
            return cls("header", name=found.group(1) or found.group(2))
        raise ValueError("must be value.<field> (a JSON value's field, value.a.b for a nested one), "
                         "headers['<name>'] or key")

    def __str__(self) -> str:
        if self.kind == "value":
            return "value." + ".".join(self.path)
        return f"headers['{self.name}']" if self.kind == "header" else "key"


class RouteTable(ConfigModel):
    """One route: the table its records land in, and how they are decoded."""
    table_uri: StrictStr = Field(min_length=1)
    format: Format
    partition_by: tuple[StrictStr, ...] = Field(default=(), description="columns of this route's table")


class Routes(ConfigModel):
    """``by``: what names a record's route; ``tables``: its table by that value; ``unrouted``: what
    becomes of a record no route takes (its ``by`` value is missing, null, or names no route)."""
    by: StrictStr = Field(description="value.<field> (a JSON value's field), headers['<name>'] or key: read from "
                                      "the record before it is decoded")
    tables: dict[StrictStr, RouteTable] = Field(min_length=1, description="by the value of `by` (text): the route's "
                                                                          "table_uri and format")
    unrouted: Literal["quarantine", "skip"] = Field(
        default="quarantine", description="quarantine: into the quarantine table with the reason; skip: counted in "
                                          "each commit record (records.unrouted), never stored")

    @field_validator("by")
    @classmethod
    def _by_form(cls, value: str) -> str:
        try:
            RouteBy.parse(value)
        except ValueError as exc:
            raise key_problem("", str(exc)) from None
        return value

    @model_validator(mode="after")
    def _tables_apart(self) -> "Routes":
        seen: dict[str, str] = {}
        for value, route in self.tables.items():
            if not value:
                raise key_problem("tables", "names a route by the empty text")
            uri = table_key(route.table_uri)
            if uri in seen:
                raise key_problem(f"tables.{value}.table_uri", f"is also the table of route {seen[uri]}")
            seen[uri] = value
        if self.parsed_by.kind == "value":
            for value, route in self.tables.items():
                if route.format.type != "json":
                    raise key_problem(f"tables.{value}.format", f"is {route.format.type}, and by: {self.by} reads the "
                                      "values as JSON: route records of other formats by headers['<name>'] or key")
            framings = {(route.format.confluent_framing, route.format.schemas_enable) for route in self.tables.values()}
            if len(framings) > 1:
                raise key_problem("tables", f"by: {self.by} reads each value before its route is known: every route's "
                                  "format.confluent_framing and format.schemas_enable must be the same")
        registries = {tuple(sorted((r.format.schema_registry or {}).items())) for r in self.tables.values()
                      if r.format.schema_registry}
        if len(registries) > 1:
            raise key_problem("tables", "every route reads the same schema registry: their format.schema_registry "
                                        "settings must be the same")
        for value, route in self.tables.items():
            if route.format.type in ("avro", "protobuf") and route.format.subject is None:
                raise key_problem(f"tables.{value}.format.subject", "is required: each route's records have a schema "
                                                                    "of their own, not the topic's")
        return self

    @property
    def parsed_by(self) -> RouteBy:
        return RouteBy.parse(self.by)


@dataclass(frozen=True)
class DataTable:
    """A table a pipeline's records land in (the quarantine table aside): its table, without
    ``routes`` (``route`` None); else one per route, ``route`` the value of ``by`` that names it."""

    route: str | None
    table_uri: str
    format: Format
    partition_by: tuple[str, ...]

    @property
    def tag(self) -> str:
        """How a part's files and commits name this table: "main", or "route:<value>"."""
        return MAIN_TAG if self.route is None else ROUTE_TAG_PREFIX + self.route

    @property
    def setting(self) -> str:
        """The key of the pipeline file that names this table, as errors say it."""
        return "sink.table_uri" if self.route is None else f"routes.tables.{self.route}.table_uri"

    def describe(self) -> str:
        """The table as a line names it: its location, and its route."""
        return self.table_uri if self.route is None else f"{self.table_uri} (route {self.route})"


def check_tables(pipeline: "Pipeline") -> None:
    """A pipeline writes one table (``format``, ``sink.table_uri``) or routes its records into
    several (``routes``, and ``sink.quarantine_uri`` for all of them): the other way's keys are
    refused, naming them."""
    sink = pipeline.sink
    if pipeline.routes is None:
        for key, value in (("format", pipeline.format), ("sink.table_uri", sink.table_uri)):
            if value is None:
                raise key_problem(key, "is required (or routes, which names a table and a format per route)")
        return
    for key, given, instead in (
            ("format", pipeline.format is not None, "each route has its own: routes.tables.<value>.format"),
            ("sink.table_uri", sink.table_uri is not None, "each route has its own: routes.tables.<value>.table_uri"),
            ("sink.tombstones_uri", sink.tombstones_uri is not None, "it is an upsert's, and routes append"),
            ("sink.partition_by", bool(sink.partition_by), "set it per route: routes.tables.<value>.partition_by"),
            ("upsert", pipeline.upsert is not None, "a route table is appended to; upserts by key need a table of "
                                                     "their own pipeline"),
            ("transform", pipeline.transform is not None, "each route's records have their own columns; routed "
                                                          "records are decoded and written without Spark SQL"),
            ("expectations", bool(pipeline.expectations), "each route's records have their own columns; routed "
                                                          "records are decoded and written without Spark SQL")):
        if given:
            raise key_problem(key, f"does not apply with routes: {instead}")
    if sink.quarantine_uri is None:
        raise key_problem("sink.quarantine_uri", "is required with routes: the quarantine of every route's "
                                                 "malformed records and of the unrouted ones")
    for value, route in pipeline.routes.tables.items():
        if same_table(route.table_uri, sink.quarantine_uri):
            raise key_problem(f"routes.tables.{value}.table_uri", "must differ from sink.quarantine_uri")
    sink.safe_on_s3(*(t.table_uri for t in pipeline.tables))
    if sink.catalog is not None:
        for value in pipeline.routes.tables:
            problem = route_name_problem(sink.catalog.table, value)
            if problem:
                raise key_problem("sink.catalog.table", problem)
