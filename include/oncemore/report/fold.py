"""The fold ``oncemore verify --replay`` compares an upsert table with (replay.py): per key, the
last applicable event in the pipeline's order among the replayed change rows and the states the
tables hold from outside them (seeds), a tombstone's rule and Debezium's placeholder applied as
the module docstrings of commit/merge.py and commit/placeholders.py say, in Spark and written
apart from that code: the audit must not share the code it audits.

Invariant: one row per key, the winner's coordinates kept (for a delete a tombstone decided, the
tombstone's), SEED saying whether a seed won.
"""

from __future__ import annotations

from oncemore.core.columns import (
    CHANGE_COLUMN,
    INVALID_COLUMN,
    OFFSET_COLUMN,
    PARTITION_COLUMN,
    SEQUENCE_COLUMN,
    TIMESTAMP_COLUMN,
    TOPIC_COLUMN,
)

COORDINATES = (TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN)
SEED = "_seed"  # in the fold: NULL for a replayed event, "row" (the table's) or "tombstone" for a seeded state


def last_events(changes, keys: list[str], sequenced: bool, seeds=None, placeholder: str | None = None):
    """Per key its last applicable event in the pipeline's order (module docstring), ``seeds``
    (under sequence_by; _seeds) competing with the events; SEED says which won. Under sequence_by
    a tombstone of the partition that winner came from, at a later offset, deletes it. A column
    holding ``placeholder`` takes the value of its key's event before it (none after a delete:
    NULL)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    kind = F.col(CHANGE_COLUMN)
    events = changes.filter(F.col(INVALID_COLUMN).isNull() & kind.isin("upsert", "delete", "tombstone"))
    marks = None
    if sequenced:
        marks = events.filter(kind == "tombstone").groupBy(*keys, TOPIC_COLUMN, PARTITION_COLUMN).agg(
            F.max(OFFSET_COLUMN).alias("_mark"))
        events, order = events.filter(kind != "tombstone"), [SEQUENCE_COLUMN, *COORDINATES]
    else:
        events, order = events.withColumn(CHANGE_COLUMN, F.when(kind == "tombstone", "delete").otherwise(kind)), \
            ["_version", *COORDINATES]
    events = events.withColumn(SEED, F.lit(None).cast("string"))
    if seeds is not None:
        types = {f.name.lower(): f.dataType for f in events.schema.fields}
        carried = [c for c in seeds.columns if c not in (*keys, *order, CHANGE_COLUMN, SEED) and c.lower() in types]
        seeds = seeds.select(*[F.col(c).cast(types[c.lower()]).alias(c) for c in (*keys, *order, *carried)],
                             CHANGE_COLUMN, SEED)
        events = events.unionByName(seeds, allowMissingColumns=True)
        # A seed at the coordinates of a replayed event of its key is that event: the event is
        # compared (a row changed in place keeps its coordinates).
        here = Window.partitionBy(*keys).orderBy(*COORDINATES).rangeBetween(Window.currentRow, Window.currentRow)
        events = (events.withColumn("_replayed_here", F.max(F.col(SEED).isNull().cast("int")).over(here))
                  .filter(F.col(SEED).isNull() | (F.col("_replayed_here") == 0)).drop("_replayed_here"))
    if placeholder is not None:
        events = _filled(events, keys, order, placeholder)
    latest = Window.partitionBy(*keys).orderBy(*[F.col(c).desc() for c in order])
    last = events.withColumn("_rank", F.row_number().over(latest)).filter(F.col("_rank") == 1).drop("_rank")
    if marks is None:
        return last
    joined = last.join(marks, [*keys, TOPIC_COLUMN, PARTITION_COLUMN], "left").withColumn(
        "_marked", (F.col(CHANGE_COLUMN) == "upsert") & F.coalesce(F.col("_mark") > F.col(OFFSET_COLUMN), F.lit(False)))
    deleted = F.col("_marked")
    return (joined.withColumn(OFFSET_COLUMN, F.when(deleted, F.col("_mark")).otherwise(F.col(OFFSET_COLUMN)))
            .withColumn(SEED, F.when(deleted, F.lit(None).cast("string")).otherwise(F.col(SEED)))
            .withColumn(CHANGE_COLUMN, F.when(deleted, F.lit("delete")).otherwise(F.col(CHANGE_COLUMN)))
            .drop("_mark", "_marked"))


def _unsent(column, data_type, placeholder: str):
    """Whether ``column`` (of Spark type ``data_type``) holds the placeholder as Debezium sends it
    for its type (the text, its bytes, a one-element array of it or of its name UUID, its bytes as
    an array of integers); None: a column of that type never does. Written apart from
    commit/merge.py's, which it audits."""
    import hashlib
    from uuid import UUID

    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, BinaryType, IntegralType, StringType

    raw = placeholder.encode()
    if isinstance(data_type, StringType):
        return column == F.lit(placeholder)
    if isinstance(data_type, BinaryType):
        return column == F.lit(bytearray(raw))
    if isinstance(data_type, ArrayType) and isinstance(data_type.elementType, StringType):
        digest = bytearray(hashlib.md5(raw).digest())
        digest[6], digest[8] = (digest[6] & 0x0F) | 0x30, (digest[8] & 0x3F) | 0x80
        return (column == F.array(F.lit(placeholder))) | (column == F.array(F.lit(str(UUID(bytes=bytes(digest))))))
    if isinstance(data_type, ArrayType) and isinstance(data_type.elementType, IntegralType):
        return column == F.array(*[F.lit(b) for b in raw]).cast(data_type)
    return None


def _filled(events, keys: list[str], order: list[str], placeholder: str):
    """``events`` with each placeholder the value of its key's latest event before it (in the
    fold's order) that is not one, since the key's last delete; NULL where there is none."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    own = {*keys, *order, CHANGE_COLUMN, INVALID_COLUMN, SEED, TIMESTAMP_COLUMN}
    types = {f.name: f.dataType for f in events.schema.fields if f.name not in own and not f.name.startswith("_")}
    tests = {name: _unsent(F.col(f"`{name}`"), kind, placeholder) for name, kind in types.items()}
    tests = {name: test for name, test in tests.items() if test is not None}
    if not tests:
        return events
    ordered = Window.partitionBy(*keys).orderBy(*order).rowsBetween(Window.unboundedPreceding, -1)
    events = events.withColumn("_since", F.coalesce(F.sum((F.col(CHANGE_COLUMN) == "delete").cast("int")).over(ordered),
                                                    F.lit(0)))
    segment = Window.partitionBy(*keys, "_since").orderBy(*order).rowsBetween(Window.unboundedPreceding, 0)
    for name, test in tests.items():
        sent = F.when(~F.coalesce(test, F.lit(False)), F.struct(F.col(f"`{name}`").alias("v")))
        events = events.withColumn(name, F.last(sent, ignorenulls=True).over(segment)["v"])
    return events.drop("_since")
