"""What a pipeline's decoded records are: its value and key formats resolved once, on the driver,
into data the executors rebuild decoders from, and the columns the records have (the view
``records`` a transform reads, and the table without a transform).

Avro and Protobuf formats are resolved against the schema registry here: the table's schema is the
subject's latest registered version (``<topic>-value`` / ``<topic>-key`` unless ``subject:`` says
otherwise), and a declared ``schema:`` must be a subset of it with the same types (its columns are
then the ones kept). Each record is still read with its own writer's schema, fetched by ID by the
executor that decodes it. Registry settings never travel with the spec: they hold secrets, and go
to executors as Spark data source options Spark redacts (``registry.<key>``, ``key.registry.<key>``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import pyarrow as pa
from confluent_kafka.schema_registry import Schema

from .config import Format, Pipeline
from .ddl import parse_ddl, to_ddl
from .decode_avro import AvroDecoder
from .decode_json import JsonDecoder
from .decode_protobuf import ProtobufDecoder
from .errors import OncemoreError
from .registry import Registry
from .schema import SchemaError, records_schema


class FormatError(OncemoreError):
    """A format cannot be resolved into table columns (no registered schema, a declared schema
    the registered one does not hold)."""


@dataclass(frozen=True)
class FormatSpec:
    """One format (a value's or a key's) as executors need it: its type, and for json the declared
    DDL, for avro and protobuf the table's registered schema (``Schema.to_dict()``), the message
    and the declared DDL that projects it."""

    type: str
    ddl: str | None = None
    registered: Mapping[str, Any] | None = None
    message: str | None = None
    framed: bool = False

    def decoder(self, registry_settings: Mapping[str, str] | None):
        """The decoder of these values (raw and string: None, decode.py handles bytes and text)."""
        if self.type == "json":
            return JsonDecoder(parse_ddl(self.ddl))
        if self.type == "avro":
            return AvroDecoder(Registry(registry_settings), Schema.from_dict(dict(self.registered)))
        if self.type == "protobuf":
            return ProtobufDecoder(Registry(registry_settings), Schema.from_dict(dict(self.registered)), self.message)
        return None

    def columns(self, registry_settings: Mapping[str, str] | None) -> pa.Schema | None:
        """The columns a record of this format becomes (json, avro, protobuf); a declared DDL keeps
        only its columns."""
        if self.type in ("raw", "string"):
            return None
        return parse_ddl(self.ddl) if self.ddl else self.decoder(registry_settings).schema


@dataclass(frozen=True)
class RecordSpec:
    """The records' formats, and whether they carry headers. Travels to executors as JSON."""

    value: FormatSpec
    key: FormatSpec | None
    headers: bool

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RecordSpec":
        data = json.loads(text)
        return cls(value=FormatSpec(**data["value"]), key=FormatSpec(**data["key"]) if data["key"] else None,
                   headers=data["headers"])

    def schema(self, value_registry: Mapping[str, str] | None, key_registry: Mapping[str, str] | None) -> pa.Schema:
        """The records' columns (schema.records_schema)."""
        key = None
        if self.key is not None:
            columns = self.key.columns(key_registry)
            if columns is None:
                key = pa.binary() if self.key.type == "raw" else pa.string()
            elif self.key.type in ("avro", "protobuf") and columns.names == ["value"]:
                key = columns.field("value").type  # a key of one plain type (an Avro "string" key)
            else:
                key = pa.struct(list(columns))
        return records_schema(self.value.type, self.value.columns(value_registry), key, self.headers)


def registries(pipeline: Pipeline) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """The registry settings of the value and of the key (a key without its own uses the value's)."""
    value = pipeline.format.schema_registry
    key = pipeline.key.schema_registry if pipeline.key is not None and pipeline.key.schema_registry else value
    return (dict(value) if value else None), (dict(key) if key else None)


def resolve(pipeline: Pipeline, topics: list[str], ahead: str | None = None) -> RecordSpec:
    """The pipeline's RecordSpec, its avro and protobuf formats resolved against the registry: the
    subject's latest schema is the table's, unless ``ahead`` ("value:<ID>", a record's writer schema
    newer than the table's) names the one to read into from now on."""
    value_registry, key_registry = registries(pipeline)
    role, _, schema_id = (ahead or "").partition(":")
    key = pipeline.key
    if key is None and pipeline.format.type == "raw":
        key_spec = FormatSpec("raw")
    else:
        key_spec = (_resolve(pipeline, key, "key", topics, key_registry, int(schema_id) if role == "key" else None)
                    if key is not None else None)
    value = _resolve(pipeline, pipeline.format, "value", topics, value_registry, int(schema_id) if role == "value" else None)
    return RecordSpec(value, key_spec, pipeline.headers)


def _resolve(pipeline: Pipeline, fmt: Format, role: str, topics: list[str], settings, schema_id: int | None) -> FormatSpec:
    block = "format" if role == "value" else "key"
    if fmt.type not in ("avro", "protobuf"):
        return FormatSpec(fmt.type, ddl=fmt.ddl, framed=fmt.confluent_framing)
    if fmt.subject is None and len(topics) != 1:
        raise FormatError(f"pipeline {pipeline.name}: {block}.subject is required: the table has one schema and the "
                          f"pipeline reads topics {', '.join(topics)}, each with a subject of its own", block=block)
    subject = fmt.subject or f"{topics[0]}-{role}"
    registry = Registry(settings)
    serialized = "serialized" if fmt.type == "protobuf" else None
    if schema_id is None:
        latest = registry.latest(subject, fmt=serialized)
        schema, source = latest.schema, f"{subject} version {latest.version}"
    else:
        schema, source = registry.schema(schema_id, fmt=serialized), f"schema ID {schema_id}"
    spec = FormatSpec(fmt.type, ddl=fmt.ddl, registered=schema.to_dict(), message=fmt.message)
    registered = FormatSpec(fmt.type, registered=spec.registered, message=fmt.message).columns(settings)
    if fmt.ddl:
        _check_declared(pipeline.name, block, source, parse_ddl(fmt.ddl), registered)
    return spec


def _check_declared(pipeline: str, block: str, source: str, declared: pa.Schema, registered: pa.Schema) -> None:
    """A declared schema picks columns of the registered one: each must be there, with its type."""
    for field in declared:
        index = registered.get_field_index(field.name)
        if index < 0:
            raise FormatError(f"pipeline {pipeline}: {block}.schema: column {field.name!r} is not in {source} "
                              f"({', '.join(registered.names)})", column=field.name)
        found = registered.field(index).type
        if not found.equals(field.type):
            raise FormatError(f"pipeline {pipeline}: {block}.schema: column {field.name!r} is {to_ddl(field.type)}, "
                              f"{source} has {to_ddl(found)}", column=field.name)


__all__ = ["FormatError", "FormatSpec", "RecordSpec", "registries", "resolve", "SchemaError"]
