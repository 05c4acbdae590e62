"""Arrow schemas: the Kafka source's rows, the declared JSON schema (Spark DDL), and the tables.

Every table carries the record's Kafka coordinates in `_kafka_*` columns, so the exactly-once
invariant can be checked by counting (partition, offset) pairs in the table itself.
"""

from __future__ import annotations

import re
import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")

# The Spark Kafka source's columns (without headers), as the Python Data Source yields them.
# Arrow types match Spark's exactly: Spark rejects e.g. int64 for an IntegerType column.
KAFKA_RECORD_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", TIMESTAMP),
        ("timestampType", pa.int32()),
    ]
)

# What a task reads before decoding: those columns plus Kafka's raw timestamp in milliseconds
# (``timestamp`` is null where a microsecond timestamp cannot hold it).
RECORD_SCHEMA = KAFKA_RECORD_SCHEMA.append(pa.field("timestamp_ms", pa.int64()))

METADATA_FIELDS = [
    pa.field("_kafka_topic", pa.string(), nullable=False),
    pa.field("_kafka_partition", pa.int32(), nullable=False),
    pa.field("_kafka_offset", pa.int64(), nullable=False),
    pa.field("_kafka_timestamp", TIMESTAMP),
]
TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN = "_kafka_topic", "_kafka_partition", "_kafka_offset"

QUARANTINE_SCHEMA = pa.schema(
    [pa.field("key", pa.binary()), pa.field("value", pa.binary()), pa.field("error", pa.string(), nullable=False)]
    + METADATA_FIELDS
)

PARTITIONABLE_TYPES = {"string", "int8", "int16", "int32", "int64", "date32[day]", "bool"}

_SIMPLE_TYPES = {
    "tinyint": pa.int8(), "byte": pa.int8(),
    "smallint": pa.int16(), "short": pa.int16(),
    "int": pa.int32(), "integer": pa.int32(),
    "bigint": pa.int64(), "long": pa.int64(),
    "float": pa.float32(), "real": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "boolean": pa.bool_(),
    "binary": pa.binary(),
    "date": pa.date32(),
    "timestamp": TIMESTAMP,
    "timestamp_ntz": pa.timestamp("us"),
}
_COLUMN = re.compile(r"^\s*(`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)\s+(.+?)\s*(NOT\s+NULL)?\s*$", re.I)
_DECIMAL = re.compile(r"^decimal\s*\(\s*(\d+)\s*,\s*(\d+)\s*\)$", re.I)
_SIZED_STRING = re.compile(r"^(var)?char\s*\(\s*\d+\s*\)$", re.I)


class SchemaError(ValueError):
    pass


def parse_schema(ddl: str) -> pa.Schema:
    """A Spark DDL column list ("id BIGINT, name STRING NOT NULL") as an Arrow schema.

    Flat types only: the JSON reader needs every column typed, and nested DDL would need a
    real parser; a nested field can be declared STRING and parsed downstream.
    """
    fields = []
    for part in _split_columns(ddl):
        match = _COLUMN.match(part)
        if not match:
            raise SchemaError(f"cannot read column definition {part.strip()!r}")
        name, type_text, not_null = match.group(1).strip("`"), match.group(2).strip(), match.group(3)
        check_column_name(name)
        fields.append(pa.field(name, _parse_type(name, type_text), nullable=not not_null))
    if not fields:
        raise SchemaError("declares no columns")
    names = [f.name.lower() for f in fields]
    duplicates = sorted({f.name for f in fields if names.count(f.name.lower()) > 1})
    if duplicates:
        raise SchemaError(f"duplicate column {duplicates[0]!r} (Delta column names ignore case)")
    return pa.schema(fields)


# Characters Delta tables without column mapping cannot hold in a column name (Spark refuses to
# read or write such a table), though Arrow and Parquet take them.
_INVALID_NAME_CHARACTERS = " ,;{}()\n\t="


def check_column_name(name: str) -> None:
    if name.lower().startswith("_kafka_"):
        raise SchemaError(f"column {name!r}: the _kafka_ prefix is reserved for record metadata")
    bad = sorted({c for c in name if c in _INVALID_NAME_CHARACTERS})
    if bad or not name:
        raise SchemaError(f"column {name!r}: a Delta table without column mapping cannot hold a column name "
                          f"{'with ' + ' '.join(repr(c) for c in bad) if bad else 'that is empty'}")


def _split_columns(ddl: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in ddl:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p for p in parts if p.strip()]


def _parse_type(name: str, text: str) -> pa.DataType:
    lowered = text.lower()
    if lowered in _SIMPLE_TYPES:
        return _SIMPLE_TYPES[lowered]
    if _SIZED_STRING.match(text):
        return pa.string()
    decimal = _DECIMAL.match(text)
    if decimal:
        precision, scale = int(decimal.group(1)), int(decimal.group(2))
        if not 1 <= precision <= 38 or scale > precision:
            raise SchemaError(f"column {name!r}: DECIMAL({precision},{scale}) is out of range")
        return pa.decimal128(precision, scale)
    raise SchemaError(
        f"column {name!r}: unsupported type {text!r} (supported: {', '.join(sorted(_SIMPLE_TYPES))}, "
        "DECIMAL(p,s), VARCHAR(n))"
    )


def main_table_schema(format_type: str, schema_ddl: str | None) -> pa.Schema:
    if format_type == "json":
        declared = list(parse_schema(schema_ddl))
    else:
        declared = [pa.field("key", pa.binary()), pa.field("value", pa.binary())]
    return pa.schema(declared + METADATA_FIELDS)
