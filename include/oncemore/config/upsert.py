"""The ``upsert`` block of a pipeline file: change events applied by key (commit/merge.py),
checked against the rest of the pipeline as the file loads."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import Field, StrictStr, model_validator

from oncemore.config.values import ConfigModel, Positive, key_problem
from oncemore.core.columns import key_type_ok

if TYPE_CHECKING:
    from oncemore.config.formats import Format


# Debezium source fields that are no order of a key's changes, refused as upsert.sequence_by by themselves.
_FILE_AND_POSITION = ("CAST(substring_index(source.file, '.', -1) AS DECIMAL(20,0)) * 4294967296 + source.pos "
                      "(a binlog position is below 2^32), or leave sequence_by out: Kafka's offset order")
NOT_AN_ORDER = {
    "pos": "restarts with every binlog file (MySQL, MariaDB): order by the file and the position together, "
           + _FILE_AND_POSITION,
    "file": "names a binlog file (MySQL, MariaDB), text: order by the file and the position together, " + _FILE_AND_POSITION,
    "row": "counts rows within one binlog event (MySQL, MariaDB) and restarts with each: order by the file and the "
           "position together, " + _FILE_AND_POSITION,
    "txId": "is a transaction's id, not an order: Oracle's is hex, PostgreSQL's is given at a transaction's first "
            "write, not at its commit (order by source.lsn)",
    "gtid": "is text, a server's UUID and that server's counter (MySQL, MariaDB): no order across servers",
    "event_serial_no": "counts the events of one change (SQL Server, Db2) and restarts with each: order by "
                       "source.commit_lsn",
    "ord": "counts the operations of one second (MongoDB) and restarts every second",
    "sequence": "is text (PostgreSQL's [last commit LSN, LSN] as a JSON array): order by source.lsn",
    "vgtid": "is text, each Vitess shard's position: no order across shards",
}


class Upsert(ConfigModel):
    """Change events applied by key (commit/merge.py): the table holds each key's latest row.

    ``envelope: debezium``: the value is Debezium's envelope and ``format`` describes its row
    (``before``/``after``; a registry schema is the envelope's, the row its ``after`` type): ops c, r
    and u upsert ``after``, d deletes, t fails the run. ``envelope: none``: the value is the row. A
    null value (a tombstone) deletes its key in offset order; under ``sequence_by`` it deletes its
    key when the key's row came from the tombstone's partition at a lower offset. A column holding
    ``unavailable_value_placeholder`` (a value Debezium did not send) keeps the value held."""

    keys: tuple[StrictStr, ...] = Field(min_length=1, description="the table's key columns (row columns; for a "
                                                                   "record with no row, the Kafka key's fields)")
    envelope: Literal["debezium", "none"] = "none"
    sequence_by: StrictStr | None = Field(
        default=None, description="a Spark SQL expression over the record (the envelope's fields for debezium), "
                                  "compared as a number (a SQL Server or Db2 hex LSN as the number of its digits): "
                                  "the greatest wins; without it, Kafka's (partition, offset). A Debezium source "
                                  "field that is no order (source.pos, txId, ...) is refused")
    delete_when: StrictStr | None = Field(default=None, description="envelope none: a Spark SQL predicate marking "
                                                                    "rows that are deletes, e.g. \"__deleted = 'true'\"")
    tombstone_retention_hours: Positive = Field(
        default=168, description="under sequence_by, how long a delete is kept against late events, in the "
                                 "stream's time (oncemore maintain forgets older ones)")
    merge: Literal["local", "cluster"] = Field(
        default="local", description="where a batch's MERGE into the table runs: local, delta-rs in the run's "
                                     "process (small tables); cluster, a copy-on-write of the touched files by "
                                     "Spark's tasks, committed with the positions in one commit (docs/upserts.md)")
    unavailable_value_placeholder: StrictStr | None = Field(
        default="__debezium_unavailable_value", min_length=1,
        description="the value a change event carries for a column it did not send (Debezium's "
                    "unavailable.value.placeholder: an unchanged TOASTed column); the key's value held is kept. "
                    "null: no value is a placeholder")

    @model_validator(mode="after")
    def _consistent(self) -> "Upsert":
        if len({k.lower() for k in self.keys}) != len(self.keys):
            raise key_problem("keys", "names a column twice")
        if self.delete_when is not None and self.envelope == "debezium":
            raise key_problem("delete_when", "applies to envelope none (Debezium's op says what is a delete)")
        named = re.fullmatch(r"\s*`?source`?\s*\.\s*`?(\w+)`?\s*", self.sequence_by or "")
        if self.envelope == "debezium" and named and named.group(1).lower() in {k.lower() for k in NOT_AN_ORDER}:
            field = next(k for k in NOT_AN_ORDER if k.lower() == named.group(1).lower())
            raise key_problem("sequence_by", f"source.{field} {NOT_AN_ORDER[field]}")
        return self

    def check_fits(self, fmt: "Format", partition_by: tuple[str, ...], shapes: bool) -> None:
        """The block against the pipeline's ``format``, ``sink.partition_by`` and whether it has a
        transform or expectations (``shapes``); a registry's columns are checked at run time
        (shape/changes.py)."""
        if shapes:
            raise key_problem("upsert", "cannot be combined with a transform or expectations yet: the change "
                                        "events are applied as decoded")
        if fmt.type in ("raw", "string"):
            raise key_problem("upsert", f"needs a format with columns (json, avro, protobuf), not {fmt.type}")
        if self.envelope == "debezium" and fmt.type != "json" and fmt.ddl:
            raise key_problem("format.schema", "does not apply to a registry's Debezium envelope: its after type is "
                                               "the row")
        declared = fmt.declared
        if declared is not None:
            names = {n.lower(): n for n in declared.names}
            for key in self.keys:
                if key.lower() not in names:
                    raise key_problem("upsert.keys", f"{key!r} is not a column of the row ({', '.join(declared.names)})")
                kind = declared.field(names[key.lower()]).type
                if not key_type_ok(kind):
                    raise key_problem("upsert.keys", f"{key!r} has type {kind}; a key column compares exactly "
                                                     "(integers, strings, dates, timestamps, booleans, binary)")
        outside = [c for c in partition_by if c.lower() not in {k.lower() for k in self.keys}]
        if outside:
            # A row partitioned by a column that can change would move partitions and stay twice.
            raise key_problem("sink.partition_by", f"{outside[0]!r} is not a key column: an upsert table is "
                                                   "partitioned by key columns only")
