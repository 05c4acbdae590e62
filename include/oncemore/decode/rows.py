"""Kafka records (Arrow batches as read, kafka/batches.py) to rows of the records schema, and quarantine
rows for the records that cannot be stored.

The value and the key each go through their format's decoder (json/, avro/,
protobuf/; raw keeps the bytes, string checks they are UTF-8), headers become Spark's
``headers`` column, and the Kafka coordinates are added. A record goes to quarantine, with its
bytes, its coordinates and the reason, when its value or its key cannot be decoded into the
table's types, when its value is null (a tombstone) and the value format is not raw (an upsert's
tombstone is a record: its columns NULL, ``_tombstone`` true; an upsert's rows also keep their
record's key and value bytes, for the quarantine of a change that cannot be applied), or when its
Kafka timestamp is one no microsecond timestamp can hold (a producer stamping another unit). Never
a NULL in place of what could not be stored: decode/decoder.py's invariant, kept for the whole record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from oncemore.core.columns import METADATA_FIELDS, QUARANTINE_SCHEMA, decoded_schema
from oncemore.core.ddl import parse_ddl
from oncemore.decode.decoder import DecodedValues, SchemaAhead
from oncemore.decode.recordspec import FormatSpec, RecordSpec

if TYPE_CHECKING:
    from oncemore.decode.json.connect import Unwrapped

_METADATA_SOURCE = {"_kafka_topic": "topic", "_kafka_partition": "partition", "_kafka_offset": "offset",
                    "_kafka_timestamp": "timestamp"}


@dataclass
class Decoded:
    good: pa.Table  # the records schema
    bad: pa.Table  # QUARANTINE_SCHEMA


class RecordDecoder:
    """Decodes batches of one pipeline's records (see the module docstring)."""

    def __init__(self, spec: RecordSpec, value_registry: Mapping[str, str] | None = None,
                 key_registry: Mapping[str, str] | None = None):
        self.spec = spec
        self.schema = decoded_columns(spec, value_registry, key_registry)
        self._value = _FormatDecoder(spec.value, value_registry, "value")
        self._key = _FormatDecoder(spec.key, key_registry, "key") if spec.key is not None else None

    def decode(self, records: pa.RecordBatch | pa.Table) -> Decoded:
        records = pa.Table.from_batches([records]) if isinstance(records, pa.RecordBatch) else records
        errors: dict[int, str] = {}
        lost = pc.and_(pc.is_null(records.column("timestamp")), pc.is_valid(records.column("timestamp_ms")))
        for i in pc.indices_nonzero(lost).to_pylist():
            errors[i] = (f"Kafka timestamp {records.column('timestamp_ms')[i].as_py()} ms is beyond what a "
                         "microsecond timestamp can hold (the producer stamped another unit?)")
        values = records.column("value").combine_chunks()
        payloads = self._value.unwrap(values, errors)
        if self.spec.value.type != "raw" and not self.spec.changes:
            for i in pc.indices_nonzero(pc.is_null(payloads.column)).to_pylist():
                errors.setdefault(i, "value is null (a tombstone), not a record" if values[i].as_py() is None
                                  else "value's payload is null (JsonConverter's null value), not a record")
        keys = self._key.unwrap(records.column("key").combine_chunks(), errors) if self._key is not None else None
        key, value = self._decode_key_and_value(keys, payloads, errors)
        columns: list[pa.ChunkedArray | pa.Array] = []
        names: list[str] = []
        if self._key is not None:
            columns.append(key)
            names.append("key")
        if self.spec.value.type in ("raw", "string"):
            columns.append(value)
            names.append("value")
        else:
            columns += value.flatten()
            names += [f.name for f in value.type]
        if self.spec.headers:
            columns.append(records.column("headers"))
            names.append("headers")
        if self.spec.changes:  # a null value, or a null payload, is a tombstone
            columns += [pc.is_null(payloads.column), records.column("key"), values]
        columns += [records.column(_METADATA_SOURCE[f.name]) for f in METADATA_FIELDS]
        rows = pa.Table.from_arrays(columns, schema=self.schema)
        if not errors:  # the common case: every record good, rows already in order
            return Decoded(rows, QUARANTINE_SCHEMA.empty_table())
        keep = np.ones(records.num_rows, dtype=bool)
        keep[list(errors)] = False
        bad_rows = sorted(errors)
        return Decoded(rows.filter(pa.array(keep)), quarantine_rows(records.take(bad_rows), [errors[i] for i in bad_rows]))

    def _decode_key_and_value(self, keys: "Payloads | None", values: "Payloads",
                              errors: dict[int, str]) -> tuple[pa.Array | None, pa.Array]:
        """The keys and values decoded; or SchemaAhead for the first record whose key or value is
        ahead of its reader (each decoder names only its own first one: the earlier of the two)."""
        found: list[SchemaAhead] = []
        key = value = None
        try:
            key = self._key.decode(keys, errors) if keys is not None else None
        except SchemaAhead as ahead:
            found.append(ahead)
        try:
            value = self._value.decode(values, errors)
        except SchemaAhead as ahead:
            found.append(ahead)
        if found:
            raise min(found, key=lambda ahead: ahead.index)
        return key, value


@dataclass(frozen=True)
class Payloads:
    """A column's values with their wire wrapping taken off (Confluent's framing, Kafka Connect's
    JsonConverter wrapper): the payloads, null where the input or its payload is null or in
    ``errors``; and, for JsonConverter's, each record's Connect schema (json/connect.py)."""

    column: pa.Array
    connect: "Unwrapped | None" = None


class _FormatDecoder:
    """One format's decoding of a column (the values, or the keys) into one Arrow array: the
    record's fields as a struct for json, avro and protobuf (a plain Avro type as itself), bytes
    for raw, text for string. Errors are added to ``errors`` by row; a key's say so."""

    def __init__(self, spec: FormatSpec, registry: Mapping[str, str] | None, role: str):
        self.spec, self.role = spec, role
        self.prefix = "key: " if role == "key" else ""
        self._decoder = format_decoder(spec, registry)
        # JSON read without schemas_enable: a value written as JsonConverter's wrapper is refused
        # (read as the row it would be a row of NULLs), unless the row's own columns are named so.
        declared = {n.lower() for n in parse_ddl(spec.ddl).names} if spec.type == "json" else set()
        self._refuses_wrapper = spec.type == "json" and not spec.schemas_enable and not declared & {"schema", "payload"}

    def unwrap(self, column: pa.Array, errors: dict[int, str]) -> Payloads:
        """``column``'s payloads (Payloads); the reason each that has none is in ``errors``."""
        if self.spec.framed:
            from oncemore.decode.framing import strip_confluent_framing

            payloads, framing_errors = strip_confluent_framing(column)
            for i, message in framing_errors.items():
                errors.setdefault(i, f"{self.prefix}{message}")
            return Payloads(payloads)
        if self.spec.schemas_enable:
            from oncemore.decode.json.connect import unwrap

            unwrapped = unwrap(column)
            for i, message in unwrapped.errors.items():
                errors.setdefault(i, f"{self.prefix}{message}")
            return Payloads(unwrapped.payloads, unwrapped)
        return Payloads(column)

    def decode(self, wrapped: Payloads, errors: dict[int, str]) -> pa.Array:
        payloads = wrapped.column
        if self.spec.type == "raw":
            return payloads
        if self.spec.type == "string":
            return _utf8(payloads, errors, self.prefix)
        if self._refuses_wrapper:
            from oncemore.decode.json.connect import wrapped as connect_wrapped

            block = "key" if self.role == "key" else "format"
            for i in connect_wrapped(payloads):
                errors.setdefault(i, f"{self.prefix}value is Kafka Connect's JsonConverter wrapper {{\"schema\": ..., "
                                     f"\"payload\": ...}} (the converter's schemas.enable=true): set {block}.schemas_enable: "
                                     "true to read its payload")
        try:
            decoded: DecodedValues = (self._decoder.decode(payloads) if wrapped.connect is None
                                      else self._decoder.decode(payloads, wrapped.connect))
        except SchemaAhead as ahead:
            raise SchemaAhead(ahead.index, ahead.schema_id, str(ahead), self.role) from None
        for i, message in decoded.errors.items():
            errors.setdefault(i, f"{self.prefix}{message}")
        table = decoded.table
        if self.spec.ddl and self.spec.type in ("avro", "protobuf"):  # a declared schema picks registered columns
            table = table.select(parse_ddl(self.spec.ddl).names)
        if self.role == "key" and table.column_names == ["value"] and self.spec.type in ("avro", "protobuf"):
            return table.column("value").combine_chunks()  # a key of one plain type
        if not table.num_columns:
            return pa.array([{} if valid else None for valid in payloads.is_valid().to_pylist()], pa.struct([]))
        # A null key is a null struct, not a struct of nulls.
        return pa.StructArray.from_arrays([c.combine_chunks() for c in table.columns], fields=list(table.schema),
                                          mask=payloads.is_null())


def _utf8(column: pa.Array, errors: dict[int, str], prefix: str) -> pa.Array:
    try:
        return column.cast(pa.string())
    except pa.ArrowInvalid:  # rare: find the values at fault, store the rest
        texts = []
        for i, value in enumerate(column.to_pylist()):
            try:
                texts.append(None if value is None else value.decode("utf-8"))
            except UnicodeDecodeError as exc:
                errors.setdefault(i, f"{prefix}not valid UTF-8 (byte {exc.start})")
                texts.append(None)
        return pa.array(texts, pa.string())


def quarantine_rows(records: pa.Table, errors: list[str]) -> pa.Table:
    """Quarantine rows for ``records`` (as read): their key and value bytes, coordinates and reasons."""
    columns = [records.column("key"), records.column("value"), pa.array(errors, pa.string())]
    columns += [records.column(_METADATA_SOURCE[f.name]) for f in METADATA_FIELDS]
    return pa.Table.from_arrays(columns, schema=QUARANTINE_SCHEMA)


def format_decoder(spec: FormatSpec, registry_settings: Mapping[str, str] | None):
    """The decoder of ``spec``'s values (raw and string: None, _FormatDecoder handles bytes and
    text). Each format's module is imported only here, where that format is read: a Python worker
    decoding JSON never imports the registry client, nor one decoding Avro records of its reader's
    own schema ID (``RegistrySchema.id``) when that schema has no references."""
    if spec.type == "json":
        from oncemore.decode.envelope import json_readings
        from oncemore.decode.json.decoder import JsonDecoder

        schema = parse_ddl(spec.ddl)
        return JsonDecoder(schema, json_readings(schema, spec.envelope == "debezium", spec.schemas_enable))
    if spec.type not in ("avro", "protobuf"):
        return None
    from oncemore.decode.registry import Registry, RegistrySchema

    registered = RegistrySchema.from_dict(spec.registered)
    if spec.type == "avro":
        from oncemore.decode.avro.decoder import AvroDecoder

        return AvroDecoder(Registry(registry_settings), registered, spec.refused)
    from oncemore.decode.protobuf.decoder import ProtobufDecoder

    return ProtobufDecoder(Registry(registry_settings), registered, spec.message, spec.refused)


def format_columns(spec: FormatSpec, registry_settings: Mapping[str, str] | None) -> pa.Schema | None:
    """The columns a record of ``spec``'s format becomes (json, avro, protobuf); a declared DDL
    keeps only its columns."""
    if spec.type in ("raw", "string"):
        return None
    return parse_ddl(spec.ddl) if spec.ddl else format_decoder(spec, registry_settings).schema


def decoded_columns(spec: RecordSpec, value_registry: Mapping[str, str] | None,
                    key_registry: Mapping[str, str] | None) -> pa.Schema:
    """The decoded records' columns (columns.decoded_schema) for ``spec``."""
    key = None
    if spec.key is not None:
        columns = format_columns(spec.key, key_registry)
        if columns is None:
            key = pa.binary() if spec.key.type == "raw" else pa.string()
        elif spec.key.type in ("avro", "protobuf") and columns.names == ["value"]:
            key = columns.field("value").type  # a key of one plain type (an Avro "string" key)
        else:
            key = pa.struct(list(columns))
    return decoded_schema(spec.value.type, format_columns(spec.value, value_registry), key, spec.headers,
                          spec.changes)
