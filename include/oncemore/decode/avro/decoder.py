"""Avro values in Confluent's wire format (magic byte 0, 4-byte schema ID, Avro binary) to table rows.

Each record is read with its writer's schema (fetched by ID from the registry, cached) and resolved
into the *reader* schema, the table's (normally the subject's latest), by Avro's resolution rules
(fastavro). Resolution silently drops what the reader lacks, so before any record of a writer schema
is read, the two schemas are compared (compare.py): a writer with a field (at any
depth), an enum symbol or a union branch the reader lacks is *ahead*, and its first record raises
``SchemaAhead`` so the caller can cut the range there and follow it (merge.py: the run reads
into a merge of the two, the table evolved for it). A writer whose logical types disagree with the
reader's (timestamp-millis against timestamp-micros, another decimal scale) cannot be resolved,
ahead or not (a merge keeps the reader's logical types): its records are errors, never values read
in the wrong unit; so are those of a writer the run ``refused`` (the table cannot take what it has).

Values reach Arrow exactly: date, time and timestamp logical types are read as their raw integers
(fastavro's datetime objects would cap years at 9999 and cost time) and scaled in integers;
decimals are checked against their precision. Column types: schemas.py.

Invariant (decode/decoder.py): every input index is a row or an error naming the field where there is
one; a registry that cannot answer (other than "no such schema ID") fails the batch instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from io import BytesIO
from typing import Any, Callable, Mapping

import fastavro
import numpy as np
import pyarrow as pa
from fastavro.read import SchemaResolutionError

from oncemore.core.columns import SchemaError
from oncemore.decode.avro.compare import compare_schemas
from oncemore.decode.avro.schemas import (
    NAMED,
    AvroSchema,
    avro_to_arrow,
    branch_key,
    has_named_branch,
    join,
    kind_of,
    logical_of,
    merged_union,
    table_schema,
    union_members,
)
from oncemore.decode.decoder import DecodedValues, SchemaAhead
from oncemore.decode.framing import split_frames
from oncemore.decode.pyrows import rows_to_table
from oncemore.decode.registry import Registry, RegistrySchema, SchemaNotFound

__all__ = ["AvroDecoder", "avro_to_arrow"]

_INT64 = (-(1 << 63), 1 << 63)


class _Unfit(ValueError):
    """A decoded value the table's type cannot hold; the message names the field."""


@dataclass(frozen=True)
class _Writer:
    """What the decoder knows about one writer schema ID."""

    readable: Any = None  # fastavro's parsed writer schema
    reader: Any = None  # fastavro's parsed reader schema, None when the writer's is the same
    error: str | None = None  # every record of this writer is an error, for this reason
    ahead: str | None = None  # the writer has what the reader lacks (SchemaAhead)


class AvroDecoder:
    """``ValueDecoder`` for Confluent-framed Avro, read into ``reader_schema`` (the table's);
    ``refused``: writer schema IDs whose records are errors, with the reason. Records of the
    reader's own ID (``reader_schema.id``) are read without asking the registry."""

    def __init__(self, registry: Registry, reader_schema: RegistrySchema, refused: Mapping[int, str] | None = None):
        self.registry, self.reader_schema, self.refused = registry, reader_schema, dict(refused or {})
        self._reader = AvroSchema.registered(registry, reader_schema)
        self.schema = table_schema(self._reader)
        self._is_record = kind_of(self._reader.logical) == "record"
        # Branches of a complex union are told apart by type; named ones only by name, which
        # fastavro gives (as a (name, value) tuple) only when asked to.
        self._tagged = has_named_branch(self._reader)
        self._convert = _converter(self._reader, self._reader.logical, "", self._tagged, set())
        self._writers: dict[int, _Writer] = {}

    def __reduce__(self):  # to Spark's Python workers: rebuilt there, with that process's registry client
        return AvroDecoder, (self.registry, self.reader_schema, self.refused)

    def decode(self, values: pa.Array) -> DecodedValues:
        frames = split_frames(values)
        errors = dict(frames.errors)
        schema_ids = frames.schema_ids.tolist()
        written = np.unique(frames.schema_ids[frames.schema_ids >= 0]).tolist()
        writers = {schema_id: self._writer(schema_id) for schema_id in written}
        for index, schema_id in enumerate(schema_ids):
            if schema_id in writers and writers[schema_id].ahead:
                raise SchemaAhead(index, schema_id, writers[schema_id].ahead)

        rows: list = [None] * len(schema_ids)
        for index, payload in enumerate(frames.payloads.to_pylist()):
            if payload is None:
                continue
            schema_id = schema_ids[index]
            writer = writers[schema_id]
            if writer.error:
                errors[index] = writer.error
                continue
            try:
                rows[index] = self._read(payload, schema_id, writer)
            except _Unfit as exc:
                errors[index] = str(exc)
            except SchemaResolutionError as exc:
                errors[index] = f"writer schema {schema_id} cannot be resolved into the table's schema: {exc}"
            except Exception as exc:  # truncated or garbage bytes fail in many ways inside fastavro
                errors[index] = (f"payload is not a record of writer schema {schema_id} (truncated or garbage?): "
                                 f"{type(exc).__name__}: {exc}".rstrip(": "))
        return DecodedValues(rows_to_table(rows, self.schema, errors, single_column=not self._is_record),
                             dict(sorted(errors.items())))

    def _read(self, payload: bytes, schema_id: int, writer: _Writer) -> Any:
        stream = BytesIO(payload)
        record = fastavro.schemaless_reader(stream, writer.readable, writer.reader, return_named_type=self._tagged)
        left = len(payload) - stream.tell()
        if left:
            raise _Unfit(f"{left} bytes left over after the record: not written with writer schema {schema_id}?")
        return self._convert(record) if self._convert else record

    def _writer(self, schema_id: int) -> _Writer:
        if schema_id not in self._writers:
            self._writers[schema_id] = self._load_writer(schema_id)
        return self._writers[schema_id]

    def _load_writer(self, schema_id: int) -> _Writer:
        if schema_id in self.refused:
            return _Writer(error=self.refused[schema_id])
        if schema_id == self.reader_schema.id:  # the reader's own: no request, its references already read
            return _Writer(self._reader.readable)
        try:
            registered = self.registry.schema(schema_id)
        except SchemaNotFound:
            return _Writer(error=f"schema ID {schema_id} is not in the registry {self.registry.url}")
        try:
            writer = AvroSchema.registered(self.registry, registered)
        except SchemaNotFound as exc:
            return _Writer(error=f"writer schema {schema_id} references what the registry does not have: {exc}")
        except SchemaError as exc:
            return _Writer(error=f"writer schema {schema_id} is {exc}")
        if writer.identity == self._reader.identity:
            return _Writer(writer.readable)
        ahead, unresolvable = compare_schemas(writer, self._reader)
        if unresolvable:
            return _Writer(error=f"writer schema {schema_id} cannot be resolved into the table's schema: "
                                 f"{'; '.join(unresolvable)}")
        if ahead:
            return _Writer(ahead=f"writer schema {schema_id} has what the table's schema lacks: {'; '.join(ahead)}")
        return _Writer(writer.readable, self._reader.readable)


Converter = Callable[[Any], Any]


def _converter(schema: AvroSchema, avro: Any, path: str, tagged: bool, records: set) -> Converter | None:
    """A function making a value fastavro decoded ready for Arrow (None: it already is). With
    ``tagged``, fastavro returns named types in unions as (name, value) tuples."""
    avro = schema.resolve(avro)
    kind, logical = kind_of(avro), logical_of(avro)
    where = path or "the value"
    if kind == "union":
        members = union_members(schema, avro)
        if len(members) == 1:
            inner = _converter(schema, members[0], path, tagged, records)
            return None if inner is None else (lambda v: None if v is None else inner(v))
        if merged_union(members):
            return None
        return _union_converter(schema, members, path, tagged, records)
    if kind == "record":
        if avro["name"] in records:
            return None  # refused by the table schema already
        inner = [(f["name"], c) for f in avro["fields"]
                 if (c := _converter(schema, f["type"], join(path, f["name"]), tagged, records | {avro["name"]}))]

        def record(value):
            for name, convert in inner:
                value[name] = convert(value[name])
            return value

        convert_record = record if inner else None
        return _untagged(convert_record) if tagged else convert_record
    if kind == "array":
        item = _converter(schema, avro["items"], path, tagged, records)
        return None if item is None else (lambda v: [item(x) for x in v])
    if kind == "map":
        value = _converter(schema, avro["values"], path, tagged, records)
        return None if value is None else (lambda v: {k: value(x) for k, x in v.items()})
    if logical == "decimal" and kind in ("bytes", "fixed"):
        limit = Decimal(10) ** (avro["precision"] - avro.get("scale", 0))

        def decimal(v):
            if v.copy_abs() >= limit:  # abs() would round to the context's 28 digits: 38 nines to 1E+28
                raise _Unfit(f"field {where}: {v} does not fit DECIMAL({avro['precision']},{avro.get('scale', 0)})")
            return v

        return _untagged(decimal) if tagged and kind == "fixed" else decimal
    if logical in ("timestamp-millis", "local-timestamp-millis") and kind == "long":
        def millis(v):
            micros = v * 1000
            if not _INT64[0] <= micros < _INT64[1]:
                raise _Unfit(f"field {where}: {v} ms is beyond what a microsecond timestamp holds")
            return micros

        return millis
    if tagged and kind in NAMED:
        return _untagged(None)
    return None


def _untagged(inner: Converter | None) -> Converter:
    """Accepts a named type's value with or without fastavro's (name, value) tag."""
    if inner is None:
        return lambda v: v[1] if type(v) is tuple else v
    return lambda v: inner(v[1] if type(v) is tuple else v)


def _union_converter(schema: AvroSchema, members: list, path: str, tagged: bool, records: set) -> Converter:
    """A complex union's value as Spark's struct of member0, member1, ...: the written branch set."""
    names = [f"member{i}" for i in range(len(members))]
    branches = {}
    for name, member in zip(names, members):
        convert = _converter(schema, member, join(path, name), tagged, records)
        branches[branch_key(schema, member)] = (name, convert)
    where = path or "the value"

    def union(value):
        if value is None:
            return None
        if type(value) is tuple:  # a named branch, tagged by fastavro
            key, value = ("named", value[0]), value[1]
        else:
            key = Decimal if isinstance(value, Decimal) else type(value)
        if key not in branches:
            raise _Unfit(f"field {where}: a {key} value matches no branch of the union")
        name, convert = branches[key]
        row = dict.fromkeys(names)
        row[name] = convert(value) if convert else value
        return row

    return union
