"""Debezium's change-event envelope as the json format reads it: the declared row (``format.schema``)
becomes the types of ``before`` and ``after``, beside ``op``, ``ts_ms`` and ``source``; and the
leaves a connector may write as more than one JSON kind, each read from all of them (json/readings.py).

A registry's Debezium schema (Avro, Protobuf) is the envelope's already; only JSON without a
registry needs this. ``source`` holds the fields that place an event in its source's log, typed as
each connector sends them (their SourceInfoStructMaker classes: debezium/debezium and the Db2,
Informix, Vitess, Spanner and YugabyteDB connectors' repositories), so that no record is refused for
the connector it came from: a field one connector sends as a number and another as text
(``source.txId``, ``source.lsn``) is read from either, as text. Fields of ``source`` not listed here
are ignored, as any undeclared JSON field is.

``upsert.sequence_by`` names an expression over the envelope; ``sequence_number`` is how one known
to be text becomes the number it is compared as: a SQL Server or Db2 LSN (``commit_lsn``,
``change_lsn``, fixed-width hex groups such as ``00000027:00000758:0005``) is the unsigned number of
its hex digits, so it orders as the connector's own Lsn.compareTo does.
"""

from __future__ import annotations

import re

import pyarrow as pa

from oncemore.core.ddl import parse_ddl, to_ddl
from oncemore.decode.json.readings import DecimalReading, Reading, TextReading

# The fields that place an event in its source's log, each as every connector that sends it types it
# (JSON numbers: INT64 or INT32; text: STRING): all (ts_ms, ts_us, ts_ns), PostgreSQL (xmin),
# MySQL and MariaDB (file, pos, row), SQL Server and Db2 (change_lsn, commit_lsn as hex text,
# event_serial_no), Informix (change_lsn, commit_lsn as decimal text), Oracle (scn, commit_scn as
# decimal text), MongoDB (ord), YugabyteDB (commit_time, record_time), all but MySQL (sequence).
_NUMBERS = ("ts_ms", "ts_us", "ts_ns", "xmin", "pos", "row", "event_serial_no", "ord", "commit_time", "record_time")
_STRINGS = ("sequence", "file", "change_lsn", "commit_lsn", "scn", "commit_scn")
# Numbers from one connector, text from another: PostgreSQL's txId and lsn are INT64; Oracle's txId
# ("6.28.807"), Informix's txId, and YugabyteDB's txId and lsn ("term:index:key:write_id:time") STRING.
TEXT_FIELDS = ("txId", "lsn")
SOURCE_DDL = "STRUCT<" + ", ".join([f"{name}: BIGINT" for name in _NUMBERS]
                                   + [f"{name}: STRING" for name in (*_STRINGS, *TEXT_FIELDS)]) + ">"
# A SQL Server LSN is 10 bytes, a Db2 one up to 16, written as hex groups of 4, 4 and the rest bytes.
_HEX_LSN = r"^[0-9a-fA-F]{8}:[0-9a-fA-F]{8}:[0-9a-fA-F]{4,16}$"
_LSN_FIELDS = ("commit_lsn", "change_lsn")


def envelope_ddl(row_ddl: str) -> str:
    """The envelope's DDL around a row declared as ``row_ddl`` (its columns' NOT NULL dropped:
    ``before`` is null for a create, ``after`` for a delete)."""
    row = parse_ddl(row_ddl)
    fields = ", ".join(f"`{f.name}`: {to_ddl(f.type)}" for f in row)
    row_type = f"STRUCT<{fields}>"
    return f"before {row_type}, after {row_type}, op STRING, ts_ms BIGINT, source {SOURCE_DDL}"


def json_readings(schema: pa.Schema, debezium: bool, schemas_enable: bool) -> dict[tuple[str, ...], Reading]:
    """The leaves of a json value of ``schema`` read from more than one JSON kind: in Debezium's
    envelope the ``source`` text fields, and every DECIMAL of the row (Debezium's decimals: a string
    is base64 of the unscaled value); with JsonConverter's schemas, every DECIMAL anywhere (a
    string is what the record's schema says, else base64 in Debezium's row, the number's text
    elsewhere)."""
    readings: dict[tuple[str, ...], Reading] = {}
    if debezium:
        readings.update({("source", name): TextReading() for name in TEXT_FIELDS})
        roots = ["before", "after"]  # the row's; source's own numbers are DECIMAL(20,0), read as numbers
    else:
        roots = schema.names if schemas_enable else []
    for root in roots:
        for reader, kind in _leaves(schema.field(root).type, (root,)):
            if pa.types.is_decimal(kind):
                readings[reader] = DecimalReading(kind, base64=debezium)
    return readings


def sequence_number(sequence_by: str) -> str:
    """Spark SQL giving ``upsert.sequence_by`` as the number it is ordered by: itself, but for a
    SQL Server or Db2 LSN (``source.commit_lsn``, ``source.change_lsn``), the unsigned number of its
    hex digits (NULL if too large for DECIMAL(38,0), hence quarantined with its reason); another
    text, such as Informix's decimal LSNs, is itself."""
    field = re.fullmatch(r"\s*`?source`?\s*\.\s*`?(\w+)`?\s*", sequence_by)
    if field is None or field.group(1).lower() not in _LSN_FIELDS:
        return sequence_by
    text = f"source.{field.group(1)}"
    groups = [f"split({text}, ':')[{i}]" for i in range(3)]
    # The three groups as one number: the first two are 32 bits each, the last 16 to 64 (4 to 16 hex digits).
    last_bits = f"(4 * length({groups[2]}))"
    number = (f"try_add(try_add(try_multiply(CAST(conv({groups[0]}, 16, 10) AS DECIMAL(38,0)), "
              f"CAST(pow(2BD, 32 + {last_bits}) AS DECIMAL(38,0))), "
              f"try_multiply(CAST(conv({groups[1]}, 16, 10) AS DECIMAL(38,0)), CAST(pow(2BD, {last_bits}) AS DECIMAL(38,0)))), "
              f"CAST(conv({groups[2]}, 16, 10) AS DECIMAL(38,0)))")
    # Both branches text: a CASE of a decimal and a string would compare as doubles (inexact).
    return f"CASE WHEN {text} RLIKE '{_HEX_LSN}' THEN CAST({number} AS STRING) ELSE {text} END"


def _leaves(kind: pa.DataType, reader: tuple[str, ...]):
    """(reader path, type) of every leaf of ``kind`` at ``reader`` (through structs, lists, maps' values)."""
    if pa.types.is_struct(kind):
        for field in kind:
            yield from _leaves(field.type, (*reader, field.name))
    elif pa.types.is_list(kind):
        yield from _leaves(kind.value_type, (*reader, "[]"))
    elif pa.types.is_map(kind):
        yield from _leaves(kind.item_type, (*reader, "[]", "value"))
    else:
        yield reader, kind

