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


def decoded_schema(value_type: str, value_columns: pa.Schema | None, key: pa.DataType | None, headers: bool) -> pa.Schema:
    """The decoded records' columns, the view ``records`` a transform reads and the table without one:
    ``key`` (when the pipeline has one), the value's columns (``value`` for raw and string, else the
    record's fields), ``headers`` (when asked for) and the Kafka coordinates. SchemaError when a field
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
