"""The columns of oncemore's tables as Arrow schemas: the ``_kafka_*`` coordinates every table
carries, the decoded records (the view ``records``, the table without a transform), the quarantine
table, and which columns may partition a table.

Every table carries the record's Kafka coordinates in `_kafka_*` columns, so the exactly-once
invariant can be checked by counting (partition, offset) pairs in the table itself.
"""

from __future__ import annotations

import base64

import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")
# Spark's Kafka source's `headers` column (includeHeaders), as PySpark's Arrow conversion has it.
HEADERS_TYPE = pa.list_(pa.field("element", pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])))

METADATA_FIELDS = [
    pa.field("_kafka_topic", pa.string(), nullable=False),
    pa.field("_kafka_partition", pa.int32(), nullable=False),
    pa.field("_kafka_offset", pa.int64(), nullable=False),
    pa.field("_kafka_timestamp", TIMESTAMP),
]
TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN, TIMESTAMP_COLUMN = (f.name for f in METADATA_FIELDS)

QUARANTINE_SCHEMA = pa.schema(
    [pa.field("key", pa.binary()), pa.field("value", pa.binary()), pa.field("error", pa.string(), nullable=False)]
    + METADATA_FIELDS
)

# How a part's files and commits name its tables (write/files.DataFile.table): the main table, the
# quarantine table, and a routed pipeline's table per route, "route:<value of routes.by>".
MAIN_TAG, QUARANTINE_TAG, ROUTE_TAG_PREFIX = "main", "quarantine", "route:"

# Upsert tables (commit/merge.py): the row's sequence (``upsert.sequence_by``, a number: never compared
# as text), the change rows' operation and the reason a change row is quarantined (oncemore's own
# columns, never the table's), a tombstone marker among the decoded records, and when a delete was
# applied (the tombstones table, kept ``upsert.tombstone_retention_hours``).
SEQUENCE_FIELD = pa.field("_sequence", pa.decimal128(38, 6))
SEQUENCE_COLUMN = SEQUENCE_FIELD.name
# The main table's property recording the sequence_by its sequences were computed with ("": none,
# Kafka's offsets); a run with another is refused until ``oncemore resequence`` accepts it.
SEQUENCE_PROPERTY = "oncemore.upsert.sequence_by"
OWN_PREFIX = "_oncemore_"
CHANGE_COLUMN = f"{OWN_PREFIX}change"  # upsert | delete | tombstone
INVALID_COLUMN = f"{OWN_PREFIX}invalid"  # NULL, or why the change cannot be applied
VERDICT_PREFIX = f"{OWN_PREFIX}expect_"  # + i: the verdict of the pipeline's i-th expectation on a row
TOMBSTONE_COLUMN = "_tombstone"  # the record's value is null
# A change record's own key and value bytes, carried beside its decoded columns: a change that
# cannot be applied is quarantined with them, as a record that does not decode is.
RECORD_BYTES_FIELDS = [pa.field(f"{OWN_PREFIX}record_key", pa.binary()), pa.field(f"{OWN_PREFIX}record_value", pa.binary())]
RECORD_KEY_COLUMN, RECORD_VALUE_COLUMN = (f.name for f in RECORD_BYTES_FIELDS)
DELETED_AT_FIELD = pa.field("_deleted_at", TIMESTAMP, nullable=False)


def change_schema(table_schema: pa.Schema | None) -> pa.Schema:
    """An upsert part's change rows (commit/merge.py): the table's columns, each taking a NULL (a
    delete's values are dropped, run/deltasink.py, whatever the table holds NOT NULL), and the change."""
    table_schema = table_schema or pa.schema([])
    return pa.schema([f.with_nullable(True) for f in table_schema], table_schema.metadata).append(
        pa.field(CHANGE_COLUMN, pa.string()))


def nullable(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field taking NULL at every depth (struct fields, list items, map
    values; a map's keys never do)."""
    return pa.schema([f.with_type(_nullable_type(f.type)).with_nullable(True) for f in schema], schema.metadata)


def _nullable_type(kind: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(kind):
        return pa.struct([f.with_type(_nullable_type(f.type)).with_nullable(True) for f in kind])
    if pa.types.is_map(kind):
        return pa.map_(kind.key_field, kind.item_field.with_type(_nullable_type(kind.item_type)).with_nullable(True),
                       kind.keys_sorted)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        item = kind.value_field.with_type(_nullable_type(kind.value_type)).with_nullable(True)
        if pa.types.is_fixed_size_list(kind):
            return pa.list_(item, kind.list_size)
        return pa.large_list(item) if pa.types.is_large_list(kind) else pa.list_(item)
    return kind


def tombstones_schema(keys: pa.Schema) -> pa.Schema:
    """The tombstones table of an upsert table keyed by ``keys``: per deleted key, the order of
    the delete (its sequence and coordinates) and when it was applied."""
    return pa.schema(list(keys) + [SEQUENCE_FIELD] + METADATA_FIELDS + [DELETED_AT_FIELD])


def key_columns(schema: pa.Schema, keys) -> list[str]:
    """The names ``keys`` (as configured, any case) have in ``schema``; SchemaError for a missing one."""
    names = {n.lower(): n for n in schema.names}
    missing = [k for k in keys if k.lower() not in names]
    if missing:
        raise SchemaError(f"key column {missing[0]!r} is not a column of the table ({', '.join(schema.names)})")
    return [names[k.lower()] for k in keys]


def key_type_ok(kind: pa.DataType) -> bool:
    """A key column's type compares exactly wherever keys are matched: no floats (NaN, -0.0), no
    nested types, and no decimals: delta-rs keeps a decimal's file statistics as a double, and its
    MERGE prunes files by them, so a key a double cannot hold would be inserted a second time."""
    return (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_date(kind) or pa.types.is_boolean(kind) or pa.types.is_binary(kind)
            or pa.types.is_timestamp(kind))


# Types a partition column may have: their values read back exactly from a partition directory name.
PARTITIONABLE_TYPES = {"string", "int8", "int16", "int32", "int64", "date32[day]", "bool"}


class SchemaError(ValueError):
    pass


def key_type(key_format, value_format_type: str, declared: pa.Schema | None) -> pa.DataType | None:
    """The ``key`` column's type for a key format known from the config alone (None: no key column;
    avro/protobuf keys are typed by the registry at run time). Format raw keeps its key as bytes."""
    kind = key_format.type if key_format is not None else ("raw" if value_format_type == "raw" else None)
    if kind is None:
        return None
    return {"raw": pa.binary(), "string": pa.string()}.get(kind) or (pa.struct(list(declared)) if declared else None)


def decoded_schema(value_type: str, value_columns: pa.Schema | None, key: pa.DataType | None, headers: bool,
                   changes: bool = False) -> pa.Schema:
    """The decoded records' columns, the view ``records`` a transform reads and the table without one:
    ``key`` (when the pipeline has one), the value's columns (``value`` for raw and string, else the
    record's fields), ``headers`` (when asked for), for an upsert's change records ``_tombstone`` (a
    null value is a record, its columns NULL) and the record's key and value bytes
    (RECORD_BYTES_FIELDS), and the Kafka coordinates. SchemaError when a field
    of the value would be a second column of the key's or the headers' name (a registry schema's:
    a declared one is refused as the config loads)."""
    fields = [pa.field("key", key)] if key is not None else []
    if value_type in ("raw", "string"):
        fields.append(pa.field("value", pa.binary() if value_type == "raw" else pa.string()))
    else:
        taken = {"key": key is not None, "headers": headers}
        for field in value_columns:
            if taken.get(field.name.lower()):
                raise SchemaError(f"the value's field {field.name!r} and the record's {field.name.lower()} would be "
                                  "two columns of one name (Delta's are case-insensitive)")
        fields += list(value_columns)
    if headers:
        fields.append(pa.field("headers", HEADERS_TYPE))
    if changes:
        fields += [pa.field(TOMBSTONE_COLUMN, pa.bool_(), nullable=False), *RECORD_BYTES_FIELDS]
    return pa.schema(fields + METADATA_FIELDS)


def check_partition_by(schema: pa.Schema, partition_by) -> None:
    """SchemaError unless every partition column is a column of ``schema`` of a partitionable type,
    and some column is left for the data files."""
    for column in partition_by:
        if schema.get_field_index(column) < 0:
            raise SchemaError(f"{column!r} is not a column of the table ({', '.join(schema.names)})")
        if str(schema.field(column).type) not in PARTITIONABLE_TYPES:
            raise SchemaError(f"{column!r} has type {schema.field(column).type}; partition by one of "
                              f"{', '.join(sorted(PARTITIONABLE_TYPES))}")
    if len(partition_by) >= len(schema.names):
        raise SchemaError("cannot partition by every column")


def schema_text(schema: pa.Schema) -> str:
    """An Arrow schema as text, exactly (Arrow IPC, base64): how table schemas travel in options."""
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def schema_from_text(text: str) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
