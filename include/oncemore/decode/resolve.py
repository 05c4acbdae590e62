"""A pipeline's value and key formats resolved once, on the driver, into the RecordSpec
(recordspec.py) its executors rebuild decoders from, and followed or refused as writers change.

Avro and Protobuf formats are resolved against the schema registry here: a run's reader schema is
at first the subject's latest registered version (``<topic>-value`` / ``<topic>-key`` unless
``subject:`` says otherwise), and a declared ``schema:`` must be a subset of it with the same types
(its columns are then the ones kept). Each record is still read with its own writer's schema,
fetched by ID by the executor that decodes it (the reader's own ID, kept in its ``RegistrySchema``,
needs no request). A record whose writer has what the reader lacks (a newer producer, or an older
one after the latest version dropped a field) stops its range; the run then ``follow``s that
writer (Avro: the merge of reader and writer, avro/merge.py; Protobuf: the writer's own schema)
or, when the table cannot take it, ``refuse``s it: its records become errors with the reason
(quarantined), so no record stops a run twice. Registry settings never travel with the spec: they
hold secrets, and go to executors one option each (``registry.<key>``, ``key.registry.<key>``:
run/kafkasource.py), which Spark redacts where they are data source options.
"""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa

from oncemore.config.formats import Format
from oncemore.config.model import Pipeline
from oncemore.config.routes import DataTable
from oncemore.core.columns import SchemaError
from oncemore.core.ddl import parse_ddl, to_ddl
from oncemore.core.errors import OncemoreError
from oncemore.decode.avro.merge import merge_schemas
from oncemore.decode.avro.schemas import AvroSchema
from oncemore.decode.envelope import envelope_ddl
from oncemore.decode.recordspec import FormatSpec, RecordSpec
from oncemore.decode.registry import Registry, RegistrySchema
from oncemore.decode.rows import format_columns, format_decoder


class FormatError(OncemoreError):
    """A format cannot be resolved into table columns (no registered schema, a declared schema
    the registered one does not hold)."""


class ReaderBehind(FormatError):
    """A record's writer schema is still ahead of the reader the run changed for it: following it
    again would go round forever."""


def registries(pipeline: Pipeline) -> tuple[dict[str, str] | None, dict[str, str] | None]:
    """The registry settings of the value and of the key, each its format's own (none where the
    format has none: settings hold secrets, and go nowhere they are not used)."""
    # Every route reads the same registry (config/routes.py): the first that names one.
    value = next((t.format.schema_registry for t in pipeline.tables if t.format.schema_registry), None)
    key = pipeline.key.schema_registry if pipeline.key is not None else None
    return (dict(value) if value else None), (dict(key) if key else None)


def resolve(pipeline: Pipeline, topics: list[str], table: DataTable | None = None) -> RecordSpec:
    """The RecordSpec of ``table``'s records (default: the main table; a route's are read with its
    own format), its avro and protobuf formats resolved against the registry: the subject's latest
    schema is the reader. A json Debezium value is read as the envelope around the declared row
    (envelope.py)."""
    table = table or pipeline.main
    value_registry, key_registry = registries(pipeline)
    key = pipeline.key
    if key is None and table.format.type == "raw":
        key_spec = FormatSpec("raw")
    else:
        key_spec = _resolve(pipeline, key, "key", topics, key_registry) if key is not None else None
    value = _resolve(pipeline, table.format, "value", topics, value_registry, table)
    if pipeline.upsert is not None and pipeline.upsert.envelope == "debezium" and value.type == "json":
        value = replace(value, ddl=envelope_ddl(value.ddl), envelope="debezium")
    return RecordSpec(value, key_spec, pipeline.headers, changes=pipeline.upsert is not None)


def follow(pipeline: Pipeline, spec: RecordSpec, role: str, schema_id: int, table: DataTable | None = None) -> RecordSpec:
    """``spec`` with the ``role``'s reader covering writer schema ``schema_id`` too, a record's
    writer that has what the reader lacks (SchemaAhead): for Avro the merge of the two
    (avro/merge.py), so records of either resolve into it and producers on both versions cost no
    further stop; for Protobuf the writer's own schema, read as the same message. SchemaError
    when no table could hold the merge, FormatError when a declared schema's column changes."""
    fmt = getattr(spec, role)
    value_registry, key_registry = registries(pipeline)
    settings = key_registry if role == "key" else value_registry
    registry = Registry(settings)
    if fmt.type == "avro":
        reader = AvroSchema.registered(registry, RegistrySchema.from_dict(fmt.registered))
        writer = AvroSchema.registered(registry, registry.schema(schema_id))
        followed = replace(fmt, registered=RegistrySchema(merge_schemas(reader, writer)).to_dict())
    else:
        followed = replace(fmt, registered=registry.schema(schema_id, fmt="serialized").to_dict(),
                           message=format_decoder(fmt, settings).message_name)
    if fmt.ddl:
        block = _block(role, table or pipeline.main)
        _check_declared(pipeline.name, block, f"the reader following schema ID {schema_id}", parse_ddl(fmt.ddl),
                        format_columns(replace(followed, ddl=None), settings))
    return replace(spec, **{role: followed})


def refuse(spec: RecordSpec, role: str, schema_id: int, reason: str) -> RecordSpec:
    """``spec`` with every record of the ``role``'s writer schema ``schema_id`` an error, for ``reason``."""
    fmt = getattr(spec, role)
    return replace(spec, **{role: replace(fmt, refused={**fmt.refused, schema_id: reason})})


def _block(role: str, table: DataTable | None) -> str:
    """The pipeline file's block of a ``role``'s format, as errors name it."""
    if role == "key":
        return "key"
    return "format" if table is None or table.route is None else f"routes.tables.{table.route}.format"


def _resolve(pipeline: Pipeline, fmt: Format, role: str, topics: list[str], settings,
             table: DataTable | None = None) -> FormatSpec:
    block = _block(role, table)
    if fmt.type not in ("avro", "protobuf"):
        return FormatSpec(fmt.type, ddl=fmt.ddl, framed=fmt.confluent_framing, schemas_enable=fmt.schemas_enable)
    if fmt.subject is None and len(topics) != 1:
        raise FormatError(f"pipeline {pipeline.name}: {block}.subject is required: the table has one schema and the "
                          f"pipeline reads topics {', '.join(topics)}, each with a subject of its own", block=block)
    subject = fmt.subject or f"{topics[0]}-{role}"
    latest = Registry(settings).latest(subject, fmt="serialized" if fmt.type == "protobuf" else None)
    spec = FormatSpec(fmt.type, ddl=fmt.ddl, registered=latest.schema.to_dict(), message=fmt.message)
    if fmt.ddl:
        _check_declared(pipeline.name, block, f"{subject} version {latest.version}", parse_ddl(fmt.ddl),
                        format_columns(replace(spec, ddl=None), settings))
    return spec


def _check_declared(pipeline: str, block: str, source: str, declared: pa.Schema, registered: pa.Schema) -> None:
    """A declared schema picks columns of the registered one: each must be there, with its type."""
    for column in declared:
        index = registered.get_field_index(column.name)
        if index < 0:
            raise FormatError(f"pipeline {pipeline}: {block}.schema: column {column.name!r} is not in {source} "
                              f"({', '.join(registered.names)})", column=column.name)
        found = registered.field(index).type
        if not found.equals(column.type):
            raise FormatError(f"pipeline {pipeline}: {block}.schema: column {column.name!r} is {to_ddl(column.type)}, "
                              f"{source} has {to_ddl(found)}", column=column.name)


__all__ = ["FormatError", "ReaderBehind", "SchemaError", "follow", "refuse", "registries", "resolve"]
