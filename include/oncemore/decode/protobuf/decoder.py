"""Protobuf values in Confluent's wire format to table rows.

A value is magic byte 0, the writer's schema ID (4 bytes, big-endian), the message indexes (which
message of the schema's file, as zigzag varints: a count, then one index per nesting level; the
single byte 0 stands for [0], the first message), then the message. Message classes are built from
the registry's descriptors (schemas.py), no generated code.

A record is parsed with the *table's* message class (the reader), which gives protobuf's own
resolution by field number, after its writer's message was compared with it: a writer with a field
number (at any depth) or an enum value the reader lacks is *ahead*, and its first record raises
``SchemaAhead``; a writer whose shared fields cannot be read as the reader's, or that wrote another
message, makes its records errors, and so does a writer the run ``refused`` (the table cannot take
what it has). Following a writer ahead, the run reads into that writer's own schema from then on
(descriptors are not merged: records of an older writer with fields the newer one lacks stop the
range again, one part per alternation).

Values follow Spark's ``from_protobuf`` defaults for presence: a field without presence (proto3
singular scalars and enums) equal to its type's default is not on the wire, so it reads as NULL
(Spark's ``emit.default.values`` is false by default); fields with presence (messages,
``optional``, oneof members, proto2) are NULL only when unset; repeated fields and maps are empty,
never NULL. Timestamps keep microseconds: their nanoseconds are truncated, as Spark does (a table
timestamp holds microseconds). Bytes the writer's schema does not define (garbage that parsed) and
enum numbers the reader does not name are errors, never dropped.

Invariant (decode/decoder.py): every input index is a row or an error naming the field where there is
one; a registry that cannot answer (other than "no such schema ID") fails the batch instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import pyarrow as pa
from google.protobuf import message_factory, unknown_fields
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from oncemore.core.columns import SchemaError
from oncemore.decode.decoder import DecodedValues, SchemaAhead
from oncemore.decode.framing import split_frames
from oncemore.decode.protobuf.schemas import (
    MESSAGE_TYPES,
    TIMESTAMP_MESSAGE,
    WRAPPERS,
    ProtoFile,
    compare_messages,
    field_type,
    is_map,
    join,
    protobuf_to_arrow,
)
from oncemore.decode.pyrows import rows_to_table
from oncemore.decode.registry import Registry, RegistrySchema, SchemaNotFound

__all__ = ["ProtobufDecoder", "protobuf_to_arrow"]

_INT64 = (-(1 << 63), 1 << 63)


class _Unfit(ValueError):
    """A parsed value the table cannot hold; the message names the field."""


Converter = Callable[[Any], Any]


def _message_converter(message: Descriptor, path: str) -> Converter:
    """A parsed message as a dict of its set fields (repeated and map fields always), ready for Arrow."""
    fields: dict[FieldDescriptor, tuple[str, Converter | None] | None] = {}
    # Repeated and map fields missing from ListFields are empty; Arrow takes a shared empty tuple for both.
    empty_collections: dict[str, tuple] = {}
    for field in message.fields:
        where = join(path, field.name)
        if field_type(field) is None:
            fields[field] = None  # an empty message: no column
        elif is_map(field):
            value = field.message_type.fields_by_name["value"]
            convert = _single_converter(value, where)
            fields[field] = (field.name, (lambda m, c=convert: {k: c(v) for k, v in m.items()}) if convert else dict)
            empty_collections[field.name] = ()
        elif field.is_repeated:
            convert = _single_converter(field, where)
            fields[field] = (field.name, (lambda r, c=convert: [c(v) for v in r]) if convert else list)
            empty_collections[field.name] = ()
        else:
            fields[field] = (field.name, _single_converter(field, where))
    where = path or message.full_name
    unknown = unknown_fields.UnknownFieldSet

    def convert_message(parsed) -> dict:
        if len(unknown(parsed)):
            numbers = sorted({f.field_number for f in unknown(parsed)})
            raise _Unfit(f"{where}: the payload has field numbers {numbers}, which its writer schema does not define")
        row = empty_collections.copy()
        for field, value in parsed.ListFields():
            if field not in fields:
                raise _Unfit(f"{where}: extension {field.full_name} has no column")
            entry = fields[field]
            if entry is not None:
                name, convert = entry
                row[name] = convert(value) if convert else value
        return row

    return convert_message


def _single_converter(field: FieldDescriptor, where: str) -> Converter | None:
    if field.type == FieldDescriptor.TYPE_ENUM:
        names = {value.number: value.name for value in field.enum_type.values}
        enum = field.enum_type.full_name

        def enum_name(number):
            if number not in names:
                raise _Unfit(f"field {where}: {number} is not a value of enum {enum}")
            return names[number]

        return enum_name
    if field.type not in MESSAGE_TYPES:
        return None
    name = field.message_type.full_name
    if name == TIMESTAMP_MESSAGE:
        def micros(timestamp):
            if not 0 <= timestamp.nanos < 1_000_000_000:
                raise _Unfit(f"field {where}: {timestamp.nanos} nanoseconds is not a valid Timestamp")
            value = timestamp.seconds * 1_000_000 + timestamp.nanos // 1000
            if not _INT64[0] <= value < _INT64[1]:
                raise _Unfit(f"field {where}: {timestamp.seconds} s is beyond what a microsecond timestamp holds")
            return value

        return micros
    if name in WRAPPERS:
        return lambda wrapper: wrapper.value
    return _message_converter(field.message_type, where)


@dataclass(frozen=True)
class _Writer:
    """What the decoder knows about one writer message (schema ID and message indexes)."""

    error: str | None = None  # every record of this writer is an error, for this reason
    ahead: str | None = None  # the writer has what the reader lacks (SchemaAhead)


class ProtobufDecoder:
    """``ValueDecoder`` for Confluent-framed Protobuf, read into the table's message: ``message``
    (a full name) of ``reader_schema`` (the registry's answer with ``fmt="serialized"``, e.g.
    ``registry.latest(subject, fmt="serialized").schema``), by default the file's first message;
    ``refused``: writer schema IDs whose records are errors, with the reason. Records of the
    reader's own ID (``reader_schema.id``) are read without asking the registry."""

    def __init__(self, registry: Registry, reader_schema: RegistrySchema, message: str | None = None,
                 refused: Mapping[int, str] | None = None):
        self.registry, self.reader_schema, self.message = registry, reader_schema, message
        self.refused = dict(refused or {})
        reader_file = ProtoFile.registered(registry, reader_schema)
        if message is None:
            self._reader = reader_file.message((0,))
        else:
            try:
                self._reader = reader_file.file.pool.FindMessageTypeByName(message)
            except KeyError:
                raise SchemaError(f"the reader schema has no message {message}") from None
        self.schema = protobuf_to_arrow(self._reader)
        self.message_name = self._reader.full_name
        self._parse = message_factory.GetMessageClass(self._reader).FromString
        self._convert = _message_converter(self._reader, "")
        # schema ID -> its file, or why there is none; the reader's own ID needs no request
        self._files: dict[int, ProtoFile | str] = {} if reader_schema.id is None else {reader_schema.id: reader_file}
        self._writers: dict[tuple[int, tuple[int, ...]], _Writer] = {}

    def __reduce__(self):  # to Spark's Python workers: rebuilt there, with that process's registry client
        return ProtobufDecoder, (self.registry, self.reader_schema, self.message, self.refused)

    def decode(self, values: pa.Array) -> DecodedValues:
        frames = split_frames(values)
        errors = dict(frames.errors)
        schema_ids = frames.schema_ids.tolist()
        payloads = frames.payloads.to_pylist()
        # First every record's writer (schema ID and message indexes): a writer ahead of the table
        # stops the batch at its first record, before anything is parsed.
        starts: list[int | None] = [None] * len(payloads)
        keys: list[tuple[int, tuple[int, ...]] | None] = [None] * len(payloads)
        for index, payload in enumerate(payloads):
            if payload is None:
                continue
            try:
                indexes, starts[index] = _message_indexes(payload)
            except ValueError as exc:
                errors[index] = f"message indexes after schema ID {schema_ids[index]}: {exc}"
                continue
            keys[index] = (schema_ids[index], indexes)
            writer = self._writer(keys[index])
            if writer.ahead:
                raise SchemaAhead(index, schema_ids[index], writer.ahead)

        rows: list = [None] * len(payloads)
        for index, key in enumerate(keys):
            if key is None:
                continue
            writer = self._writers[key]
            if writer.error:
                errors[index] = writer.error
                continue
            try:
                rows[index] = self._convert(self._parse(memoryview(payloads[index])[starts[index]:]))
            except DecodeError as exc:
                errors[index] = (f"payload is not a {self._reader.full_name} message of writer schema {key[0]} "
                                 f"(truncated or garbage?): {exc}")
            except _Unfit as exc:
                errors[index] = str(exc)
        return DecodedValues(rows_to_table(rows, self.schema, errors), dict(sorted(errors.items())))

    def _writer(self, key: tuple[int, tuple[int, ...]]) -> _Writer:
        if key not in self._writers:
            self._writers[key] = self._load_writer(*key)
        return self._writers[key]

    def _load_writer(self, schema_id: int, indexes: tuple[int, ...]) -> _Writer:
        if schema_id in self.refused:
            return _Writer(error=self.refused[schema_id])
        if schema_id not in self._files:
            self._files[schema_id] = self._load_file(schema_id)
        found = self._files[schema_id]
        if isinstance(found, str):
            return _Writer(error=found)
        try:
            writer = found.message(indexes)
        except LookupError as exc:
            return _Writer(error=f"writer schema {schema_id}: {exc}")
        if writer.full_name != self._reader.full_name:
            return _Writer(error=f"writer schema {schema_id} wrote a {writer.full_name} message; the table holds "
                                 f"{self._reader.full_name}")
        ahead, unreadable = compare_messages(writer, self._reader)
        if ahead:
            return _Writer(ahead=f"writer schema {schema_id} has what the table's schema lacks: {'; '.join(ahead)}")
        if unreadable:
            return _Writer(error=f"writer schema {schema_id} cannot be read as the table's message: "
                                 f"{'; '.join(unreadable)}")
        return _Writer()

    def _load_file(self, schema_id: int) -> ProtoFile | str:
        """The writer schema's file, or why there is none."""
        try:
            registered = self.registry.schema(schema_id, fmt="serialized")
        except SchemaNotFound:
            return f"schema ID {schema_id} is not in the registry {self.registry.url}"
        try:
            return ProtoFile.registered(self.registry, registered)
        except SchemaNotFound as exc:
            return f"writer schema {schema_id} imports what the registry does not have: {exc}"
        except SchemaError as exc:
            return f"writer schema {schema_id} is {exc}"


def _message_indexes(payload: bytes) -> tuple[tuple[int, ...], int]:
    """Confluent's message indexes at the start of ``payload`` and where the message starts."""
    if payload[:1] == b"\x00":
        return (0,), 1
    count, position = _zigzag_varint(payload, 0)
    if not 0 < count <= 100:
        raise ValueError(f"{count} message indexes is not a valid count")
    indexes = []
    for _ in range(count):
        index, position = _zigzag_varint(payload, position)
        indexes.append(index)
    return tuple(indexes), position


def _zigzag_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data):
            raise ValueError("the value ends inside them")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (value >> 1) ^ -(value & 1), position
        if shift > 63:
            raise ValueError("a varint longer than 64 bits")
