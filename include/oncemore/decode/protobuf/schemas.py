"""Protobuf schemas as oncemore's tables see them: a registered schema's file built with what it
imports, its messages' column types following Spark's ``from_protobuf``, and how a writer's message
stands to the table's (reader's) one.

Schemas come from the registry as confluent-kafka's serializer registers them: a base64
FileDescriptorProto (asked for with ``format=serialized``, as its deserializer does), with
references for imported files registered under other subjects; well-known types
(google/protobuf/timestamp.proto, ...) are taken from the protobuf runtime, as the client does.

Mapping (``protobuf_to_arrow``): the message's fields are the columns. int32/sint32/sfixed32 ->
int32, int64/sint64/sfixed64 -> int64, uint32/fixed32 -> int64 and uint64/fixed64 -> DECIMAL(20,0)
(Spark's ``upcast.unsigned.ints``: int64 would turn values above 2^63-1 negative), bool, string,
bytes -> binary, float, double, enum -> string (the value's name), message -> struct, repeated ->
list, map<K,V> -> map, google.protobuf.Timestamp -> TIMESTAMP (UTC), wrapper types
(google.protobuf.Int64Value, ...) -> their nullable scalar (Spark's
``unwrap.primitive.wrapper.types``). Messages without fields (google.protobuf.Empty) have no
column, as in Spark; a recursive message is a ``SchemaError``. Every field is nullable.

Comparing a writer's message with the reader's (``compare_messages``, by field number, as protobuf
parses) collects what the reader would drop (a field number or enum value it lacks: the writer
is *ahead*) and what it would misread (another type other than widening int32 to int64, another
repeatedness, another well-known type).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

# confluent-kafka's Protobuf serdes put every file they treat as built in (google/protobuf/*,
# google/type/*, confluent/*) into protobuf's default pool on import; schemas importing one of
# them carry no reference for it, so it is copied from there.
import confluent_kafka.schema_registry.protobuf  # noqa: F401
import pyarrow as pa
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError

from oncemore.core.columns import TIMESTAMP, SchemaError
from oncemore.core.ddl import check_names
from oncemore.decode.registry import Registry, RegistrySchema

_UNSIGNED_64 = pa.decimal128(20, 0)
_SCALAR_ARROW = {
    FieldDescriptor.TYPE_INT32: pa.int32(), FieldDescriptor.TYPE_SINT32: pa.int32(),
    FieldDescriptor.TYPE_SFIXED32: pa.int32(), FieldDescriptor.TYPE_INT64: pa.int64(),
    FieldDescriptor.TYPE_SINT64: pa.int64(), FieldDescriptor.TYPE_SFIXED64: pa.int64(),
    FieldDescriptor.TYPE_UINT32: pa.int64(), FieldDescriptor.TYPE_FIXED32: pa.int64(),
    FieldDescriptor.TYPE_UINT64: _UNSIGNED_64, FieldDescriptor.TYPE_FIXED64: _UNSIGNED_64,
    FieldDescriptor.TYPE_BOOL: pa.bool_(), FieldDescriptor.TYPE_STRING: pa.string(),
    FieldDescriptor.TYPE_BYTES: pa.binary(), FieldDescriptor.TYPE_FLOAT: pa.float32(),
    FieldDescriptor.TYPE_DOUBLE: pa.float64(), FieldDescriptor.TYPE_ENUM: pa.string(),
}
WRAPPERS = {
    "google.protobuf.DoubleValue": pa.float64(), "google.protobuf.FloatValue": pa.float32(),
    "google.protobuf.Int64Value": pa.int64(), "google.protobuf.UInt64Value": _UNSIGNED_64,
    "google.protobuf.Int32Value": pa.int32(), "google.protobuf.UInt32Value": pa.int64(),
    "google.protobuf.BoolValue": pa.bool_(), "google.protobuf.StringValue": pa.string(),
    "google.protobuf.BytesValue": pa.binary(),
}
TIMESTAMP_MESSAGE = "google.protobuf.Timestamp"
MESSAGE_TYPES = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP)
# Field type changes a reader can take without changing any value: protobuf parses these
# varints alike, and the wider type holds every value of the narrower one.
_WIDENINGS = {(FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64),
              (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64),
              (FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64)}
_TYPE_NAMES = {number: name.removeprefix("TYPE_").lower()
               for name, number in vars(FieldDescriptor).items() if name.startswith("TYPE_")}


@dataclass(frozen=True)
class ProtoFile:
    """A registered schema's file, built in a pool of its own with everything it imports."""

    file: FileDescriptor
    proto: descriptor_pb2.FileDescriptorProto

    @classmethod
    def registered(cls, registry: Registry, schema: RegistrySchema) -> "ProtoFile":
        if schema.schema_type != "PROTOBUF":
            raise SchemaError(f"a {schema.schema_type or 'AVRO'} schema, not Protobuf")
        pool = descriptor_pool.DescriptorPool()
        added: set[str] = set()

        def add_references(references) -> None:
            for reference in references or []:
                if reference.name in added:
                    continue
                found = registry.version(reference.subject, reference.version, fmt="serialized").schema
                add_references(found.references)
                _add(pool, _file_proto(found.schema_str, reference.name), added)

        add_references(schema.references)
        proto = _file_proto(schema.schema_str, None)
        _add(pool, proto, added)
        return cls(pool.FindFileByName(proto.name), proto)

    def message(self, indexes: tuple[int, ...]) -> Descriptor:
        """The message Confluent's message indexes point at: [i] is the file's i-th message,
        [i, j] the j-th message nested in it, and so on."""
        path, level = [], self.proto.message_type
        for index in indexes:
            if not 0 <= index < len(level):
                raise LookupError(f"message indexes {list(indexes)} point at no message")
            path.append(level[index].name)
            level = level[index].nested_type
        return self.file.pool.FindMessageTypeByName(".".join(filter(None, [self.proto.package, *path])))


def _file_proto(text: str, name: str | None) -> descriptor_pb2.FileDescriptorProto:
    try:
        proto = descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError, DecodeError):
        raise SchemaError("not a serialized FileDescriptorProto (is it .proto text? oncemore asks the registry "
                          "for format=serialized, as confluent-kafka's deserializer does)") from None
    if name is not None:
        proto.name = name  # the name the importing file uses for it
    proto.name = proto.name or "default"
    return proto


def _add(pool: descriptor_pool.DescriptorPool, proto: descriptor_pb2.FileDescriptorProto, added: set[str]) -> None:
    for dependency in proto.dependency:
        if dependency not in added:
            _add_builtin(pool, dependency, added)
    try:
        pool.Add(proto)
    except TypeError as exc:  # protobuf's error for a file that does not build
        raise SchemaError(f"file {proto.name} does not build: {exc}") from None
    added.add(proto.name)


def _add_builtin(pool: descriptor_pool.DescriptorPool, name: str, added: set[str]) -> None:
    try:
        builtin = descriptor_pool.Default().FindFileByName(name)
    except KeyError:
        raise SchemaError(f"imports {name}, which is neither a schema reference nor a well-known type") from None
    for dependency in builtin.dependencies:
        if dependency.name not in added:
            _add_builtin(pool, dependency.name, added)
    pool.AddSerializedFile(builtin.serialized_pb)
    added.add(name)


def protobuf_to_arrow(message: Descriptor) -> pa.Schema:
    """The table schema for a message: its fields become the columns."""
    table = pa.schema(list(_message_type(message, "", ())))
    check_names(table)
    return table


def _message_type(message: Descriptor, path: str, messages: tuple[str, ...]) -> pa.StructType:
    if message.full_name in messages:
        raise SchemaError(f"{path or 'the message'}: message {message.full_name} contains itself, which a table "
                          "column cannot (Spark's from_protobuf refuses recursive messages too)")
    fields = []
    for field in message.fields:
        kind = field_type(field, join(path, field.name), messages + (message.full_name,))
        if kind is not None:
            fields.append(pa.field(field.name, kind))
    lowered = [f.name.lower() for f in fields]
    twice = sorted({f.name for f in fields if lowered.count(f.name.lower()) > 1})
    if twice:
        raise SchemaError(f"{path or message.full_name}: fields {', '.join(twice)} differ only in case, "
                          "which Delta column names cannot")
    return pa.struct(fields)


def field_type(field: FieldDescriptor, path: str = "", messages: tuple[str, ...] = ()) -> pa.DataType | None:
    """A field's column type; None for a message without fields (left out, as Spark does)."""
    if is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        value_type = _single_type(value, path, messages)
        if value_type is None:
            return None
        return pa.map_(pa.field("key", _single_type(key, path, messages), nullable=False),
                       pa.field("value", value_type))
    kind = _single_type(field, path, messages)
    if kind is None or not field.is_repeated:
        return kind
    return pa.list_(pa.field("element", kind))


def _single_type(field: FieldDescriptor, path: str, messages: tuple[str, ...]) -> pa.DataType | None:
    if field.type not in MESSAGE_TYPES:
        return _SCALAR_ARROW[field.type]
    name = field.message_type.full_name
    if name == TIMESTAMP_MESSAGE:
        return TIMESTAMP
    if name in WRAPPERS:
        return WRAPPERS[name]
    kind = _message_type(field.message_type, path, messages)
    return kind if kind.num_fields else None


def is_map(field: FieldDescriptor) -> bool:
    return field.type in MESSAGE_TYPES and field.message_type.GetOptions().map_entry


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def compare_messages(writer: Descriptor, reader: Descriptor) -> tuple[list[str], list[str]]:
    """Where the writer message has what the reader lacks (ahead: parsing would keep it as unknown
    fields, no column) and where a field the two share cannot be read as the reader's type
    (unreadable), matching fields by number as protobuf does."""
    ahead: list[str] = []
    unreadable: list[str] = []
    _compare(writer, reader, "", ahead, unreadable, set())
    return ahead, unreadable


def _compare(writer: Descriptor, reader: Descriptor, path: str, ahead: list[str], unreadable: list[str],
             seen: set) -> None:
    if (writer.full_name, reader.full_name) in seen:
        return
    seen.add((writer.full_name, reader.full_name))
    for field in writer.fields:
        where = join(path, field.name)
        target = reader.fields_by_number.get(field.number)
        if target is None:
            ahead.append(f"field {where} (number {field.number})")
            continue
        if field.is_repeated != target.is_repeated:
            unreadable.append(f"{where} is {'repeated' if field.is_repeated else 'singular'} in the writer, "
                              f"{'repeated' if target.is_repeated else 'singular'} in the table")
        elif field.type != target.type and (field.type, target.type) not in _WIDENINGS:
            unreadable.append(f"{where} is {_TYPE_NAMES[field.type]} in the writer, "
                              f"{_TYPE_NAMES[target.type]} in the table")
        elif field.type == FieldDescriptor.TYPE_ENUM:
            known = {value.number for value in target.enum_type.values}
            missing = [value.name for value in field.enum_type.values if value.number not in known]
            if missing:
                ahead.append(f"{where} values {', '.join(missing)}")
        elif field.type in MESSAGE_TYPES:
            names = field.message_type.full_name, target.message_type.full_name
            if {TIMESTAMP_MESSAGE, *WRAPPERS} & set(names):  # a column of its own type, not a struct
                if names[0] != names[1]:
                    unreadable.append(f"{where} is {names[0]} in the writer, {names[1]} in the table")
            else:
                _compare(field.message_type, target.message_type, where, ahead, unreadable, seen)
