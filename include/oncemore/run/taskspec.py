"""What a Spark task needs to turn a part's records into table files (TaskSpec): the tables it
writes (TableSpec: the main table, or one per route, each with the offsets it still needs), how
records are routed to them, the quarantine table and its floors.

Travels to executors as a reading option (JSON, run/kafkasource.py); the storage and registry
settings travel apart, one option each, so Spark redacts secret ones where they are data source options.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Mapping

import pyarrow as pa

from oncemore.core.columns import QUARANTINE_SCHEMA, QUARANTINE_TAG, schema_from_text, schema_text
from oncemore.decode.recordspec import RecordSpec
from oncemore.decode.routing import RouterSpec
from oncemore.decode.rows import RecordDecoder
from oncemore.write.files import TableWriter


@dataclass(frozen=True)
class TableSpec:
    """One table a task writes records into: how its records are decoded, its schema (files are
    written in it), where, partitioned how, and per "topic/partition" the first offset it still
    needs (``floors``: its own position; none for a table the part starts at, the main table)."""

    tag: str  # config/routes.DataTable.tag
    records: RecordSpec
    table_schema: pa.Schema
    table_uri: str
    partition_by: tuple[str, ...]
    floors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"tag": self.tag, "records": json.loads(self.records.to_json()), "table_schema": schema_text(self.table_schema),
                "table_uri": self.table_uri, "partition_by": list(self.partition_by), "floors": self.floors}

    @classmethod
    def from_dict(cls, data: Mapping) -> "TableSpec":
        return cls(data["tag"], RecordSpec.from_json(json.dumps(data["records"])), schema_from_text(data["table_schema"]),
                   data["table_uri"], tuple(data["partition_by"]), data["floors"])

    def writer(self, storage_options: Mapping[str, str]) -> TableWriter:
        return TableWriter(self.tag, self.table_uri, self.table_schema, self.partition_by, storage_options)


@dataclass(frozen=True)
class TaskSpec:
    """What a task needs to turn records into table files: its tables (the main table, or one per
    route, each routed to by ``router``), the quarantine table and its floors. Travels as a reading
    option (``to_json``); the storage and registry settings travel apart, one option each
    (``storage.<KEY>``, ``registry.<key>``, ``key.registry.<key>``), so Spark redacts secret ones
    where they are data source options."""

    tables: tuple[TableSpec, ...]
    quarantine_uri: str
    # Per "topic/partition", the first offset the quarantine table still needs (its own position).
    quarantine_floors: dict[str, int]
    storage_options: dict[str, str] = field(default_factory=dict)
    value_registry: dict[str, str] | None = None
    key_registry: dict[str, str] | None = None
    router: RouterSpec | None = None  # routes: which of ``tables`` each record goes to
    skip_unrouted: bool = False  # routes.unrouted: skip (counted) rather than quarantine

    @classmethod
    def single(cls, records: RecordSpec, table_schema: pa.Schema, table_uri: str, quarantine_uri: str,
               partition_by: tuple[str, ...], quarantine_floors: dict[str, int], storage_options=None,
               value_registry=None, key_registry=None) -> "TaskSpec":
        """The spec of a pipeline of one table, the main table."""
        return cls((TableSpec("main", records, table_schema, table_uri, tuple(partition_by)),), quarantine_uri,
                   quarantine_floors, dict(storage_options or {}), value_registry, key_registry)

    @property
    def main(self) -> TableSpec:
        """The one table of a pipeline without routes (what a transform's records are decoded for)."""
        assert self.router is None, "a routed task has a table per route"
        return self.tables[0]

    @property
    def records(self) -> RecordSpec:
        return self.main.records

    @property
    def table_schema(self) -> pa.Schema:
        return self.main.table_schema

    @property
    def reads_headers(self) -> bool:
        """Whether records are read with their headers: a table keeps them, or they name the route."""
        return any(t.records.headers for t in self.tables) or (self.router is not None and self.router.kind == "header")

    def to_json(self) -> str:
        return json.dumps({
            "tables": [t.to_dict() for t in self.tables], "quarantine_uri": self.quarantine_uri,
            "quarantine_floors": self.quarantine_floors,
            "router": asdict(self.router) if self.router is not None else None, "skip_unrouted": self.skip_unrouted,
        })

    @classmethod
    def from_json(cls, text: str, storage_options: Mapping[str, str], value_registry: Mapping[str, str] | None,
                  key_registry: Mapping[str, str] | None) -> "TaskSpec":
        data = json.loads(text)
        return cls(tables=tuple(TableSpec.from_dict(t) for t in data["tables"]), quarantine_uri=data["quarantine_uri"],
                   quarantine_floors=data["quarantine_floors"], storage_options=dict(storage_options),
                   value_registry=dict(value_registry) if value_registry else None,
                   key_registry=dict(key_registry) if key_registry else None,
                   router=RouterSpec.from_dict(data["router"]) if data["router"] else None,
                   skip_unrouted=data["skip_unrouted"])

    def decoder(self) -> RecordDecoder:
        """The main table's decoder (a pipeline without routes)."""
        return RecordDecoder(self.records, self.value_registry, self.key_registry)

    def decoders(self) -> dict[str, RecordDecoder]:
        """Each table's decoder, by tag."""
        return {t.tag: RecordDecoder(t.records, self.value_registry, self.key_registry) for t in self.tables}

    def quarantine_writer(self) -> TableWriter:
        return TableWriter(QUARANTINE_TAG, self.quarantine_uri, QUARANTINE_SCHEMA, (), self.storage_options)

    def writers(self) -> dict[str, TableWriter]:
        """A writer per table, by tag: the tables', then the quarantine table's."""
        return {**{t.tag: t.writer(self.storage_options) for t in self.tables}, QUARANTINE_TAG: self.quarantine_writer()}
