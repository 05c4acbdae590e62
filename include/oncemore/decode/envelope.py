"""Debezium's change-event envelope as the json format reads it: the declared row (``format.schema``)
becomes the types of ``before`` and ``after``, beside ``op``, ``ts_ms`` and ``source``.

A registry's Debezium schema (Avro, Protobuf) is the envelope's already; only JSON without a
registry needs this. ``source`` holds the position fields Debezium's connectors document, each with
its documented type, so ``upsert.sequence_by`` can name one (``source.lsn``) and compare it as a
number; fields of ``source`` not listed here are ignored, as any undeclared JSON field is.
"""

from __future__ import annotations

from oncemore.core.ddl import parse_ddl, to_ddl

# Debezium's source block: PostgreSQL (lsn, txId, xmin, sequence), MySQL (file, pos, row, server_id,
# gtid, thread), SQL Server (change_lsn, commit_lsn, event_serial_no), Oracle (scn, commit_scn),
# MongoDB (ord), and the fields all share.
SOURCE_DDL = ("STRUCT<version: STRING, connector: STRING, name: STRING, ts_ms: BIGINT, ts_us: BIGINT, ts_ns: BIGINT, "
              "db: STRING, schema: STRING, table: STRING, lsn: BIGINT, txId: BIGINT, xmin: BIGINT, "
              "sequence: STRING, file: STRING, pos: BIGINT, row: INT, server_id: BIGINT, gtid: STRING, "
              "thread: BIGINT, change_lsn: STRING, commit_lsn: STRING, event_serial_no: BIGINT, scn: STRING, "
              "commit_scn: STRING, ord: INT>")


def envelope_ddl(row_ddl: str) -> str:
    """The envelope's DDL around a row declared as ``row_ddl`` (its columns' NOT NULL dropped:
    ``before`` is null for a create, ``after`` for a delete)."""
    row = parse_ddl(row_ddl)
    fields = ", ".join(f"`{f.name}`: {to_ddl(f.type)}" for f in row)
    row_type = f"STRUCT<{fields}>"
    return f"before {row_type}, after {row_type}, op STRING, ts_ms BIGINT, source {SOURCE_DDL}"
