"""An upsert pipeline's decoded records as change rows, in Spark SQL: the row (Debezium's ``after``,
or the value itself), the record's headers when the pipeline reads them, its coordinates, its sequence, what the change is
(``_oncemore_change``: upsert, delete, tombstone, truncate) and why it cannot be applied
(``_oncemore_invalid``: NULL when it can).

Invariant: one change row per record, each with its coordinates as read, and its key and value
bytes where the sink may quarantine it; a record that cannot be applied (an unknown op, a create
without ``after``, a NULL key column, a NULL sequence) carries its reason, and the sink quarantines
it with its bytes, never drops it (as one whose value the table cannot hold: rows with partition
columns or an ARRAY or MAP keep their bytes for it). A tombstone's key columns come from the Kafka key; so do a
Debezium delete's where ``before`` lacks them. The sequence is ``try_cast(sequence_by AS
DECIMAL(38,6))``: a number, never text (a non-numeric value is NULL, hence quarantined with its
reason); a Debezium field known to be text of a number written otherwise (a SQL Server or Db2 LSN
in hex) becomes that number first (decode/envelope.py).
"""

from __future__ import annotations

from oncemore.config.model import Pipeline
from oncemore.core.columns import (
    CHANGE_COLUMN,
    INVALID_COLUMN,
    METADATA_FIELDS,
    RECORD_BYTES_FIELDS,
    SEQUENCE_COLUMN,
    TOMBSTONE_COLUMN,
    key_type_ok,
)
from oncemore.core.errors import OncemoreError
from oncemore.decode.envelope import sequence_number


class UpsertRefused(OncemoreError):
    """An upsert block that does not fit the records (a key that is no column of the row or of a
    type that does not compare exactly, a sequence_by or delete_when that does not resolve)."""


_DEBEZIUM = ("before", "after", "op")


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def change_rows(records, pipeline: Pipeline):
    """``records`` (the decoded records DataFrame) as change rows (module docstring)."""
    from pyspark.sql.pandas.types import to_arrow_type
    from pyspark.sql.types import StructType

    upsert = pipeline.upsert
    schema = records.schema
    names = set(schema.fieldNames())
    coordinates = [f.name for f in METADATA_FIELDS]
    record_bytes = [f.name for f in RECORD_BYTES_FIELDS]
    where = f"pipeline {pipeline.name}: upsert"
    # The record's own columns beside its value's: a value field may have any other name.
    keyed = pipeline.key is not None or pipeline.format.type == "raw"
    extra = ["headers"] if pipeline.headers else []
    if upsert.envelope == "debezium":
        missing = [n for n in _DEBEZIUM if n not in names]
        if missing or not isinstance(schema["after"].dataType, StructType):
            lacks = ", ".join(missing) or "a row in after"
            raise UpsertRefused(f"{where}: the value is not a Debezium envelope (it lacks {lacks}; columns: "
                                f"{', '.join(sorted(names))})", columns=sorted(names))
        row = schema["after"].dataType
        before = {f.name.lower() for f in schema["before"].dataType} if isinstance(schema["before"].dataType,
                                                                                StructType) else set()
    else:
        own = {*(["key"] if keyed else []), *extra, TOMBSTONE_COLUMN, *record_bytes, *coordinates}
        row = StructType([f for f in schema if f.name not in own])
    by_lower = {f.name.lower(): f for f in row}
    for key in upsert.keys:
        if key.lower() not in by_lower:
            raise UpsertRefused(f"{where}.keys: {key!r} is not a column of the row ({', '.join(row.fieldNames())})",
                                key=key)
    keys = [by_lower[k.lower()] for k in upsert.keys]
    for key in keys:
        if not key_type_ok(to_arrow_type(key.dataType)):
            raise UpsertRefused(f"{where}.keys: {key.name!r} has type {key.dataType.simpleString()}; a key column "
                                "compares exactly (integers, strings, dates, timestamps, booleans, binary)",
                                key=key.name)
    key_names = {k.name for k in keys}
    key_type = schema["key"].dataType if keyed else None

    def kafka_key(field) -> str:
        if isinstance(key_type, StructType):
            found = {f.name.lower(): f.name for f in key_type}.get(field.name.lower())
            return f"try_cast(key.{_q(found)} AS {field.dataType.simpleString()})" if found else "NULL"
        if key_type is not None and len(keys) == 1:
            return f"try_cast(CAST(key AS STRING) AS {field.dataType.simpleString()})"
        return "NULL"

    tombstone = _q(TOMBSTONE_COLUMN)
    columns, values = [], {}
    if upsert.envelope == "debezium":
        change = (f"CASE WHEN {tombstone} THEN 'tombstone' WHEN op IN ('c', 'r', 'u') THEN 'upsert' "
                  "WHEN op = 'd' THEN 'delete' WHEN op = 't' THEN 'truncate' END")
        for field in row:
            if field.name in key_names:
                from_before = f"before.{_q(field.name)}" if field.name.lower() in before else "NULL"
                value = (f"CASE WHEN {tombstone} THEN {kafka_key(field)} WHEN op = 'd' THEN "
                         f"coalesce({from_before}, {kafka_key(field)}) ELSE after.{_q(field.name)} END")
            else:
                value = f"CASE WHEN op = 'd' THEN NULL ELSE after.{_q(field.name)} END"
            values[field.name] = value
            columns.append(f"{value} AS {_q(field.name)}")
        invalid = [(f"NOT {tombstone} AND (op IS NULL OR op NOT IN ('c', 'r', 'u', 'd', 't'))",
                    "concat('Debezium op ', coalesce(concat('''', op, ''''), 'NULL'), ' is not c, r, u, d or t')"),
                   (f"NOT {tombstone} AND op IN ('c', 'r', 'u') AND after IS NULL",
                    "concat('Debezium op ', op, ' carries no after')")]
        rekeyed = [f"before.{_q(k.name)} IS NOT NULL AND NOT (before.{_q(k.name)} <=> after.{_q(k.name)})"
                   for k in keys if k.name.lower() in before]
        if rekeyed:
            # A key change sent as one update: applying it by its after key would leave the old
            # key's row (Debezium itself sends d, tombstone and c).
            invalid.append((f"NOT {tombstone} AND op = 'u' AND ({' OR '.join(rekeyed)})",
                            "concat('Debezium op u changes the key (before ', to_json(before), '): a key change is "
                            "applied as a delete of the old key and a create of the new one')"))
    else:
        deletes = f"coalesce(({upsert.delete_when}), false)" if upsert.delete_when else "false"
        change = f"CASE WHEN {tombstone} THEN 'tombstone' WHEN {deletes} THEN 'delete' ELSE 'upsert' END"
        for field in row:
            value = f"CASE WHEN {tombstone} THEN {kafka_key(field)} ELSE {_q(field.name)} END" \
                if field.name in key_names else _q(field.name)
            values[field.name] = value
            columns.append(f"{value} AS {_q(field.name)}")
        invalid = []
    sequenced = upsert.sequence_by is not None
    applies = f"NOT {tombstone}" if sequenced else "true"  # under sequence_by a tombstone is a compaction marker
    for key in keys:
        invalid.append((f"{applies} AND ({values[key.name]}) IS NULL", f"'key column {_sql_text(key.name)} is NULL'"))
    if sequenced:
        ordered = sequence_number(upsert.sequence_by) if upsert.envelope == "debezium" else upsert.sequence_by
        sequence = f"try_cast(({ordered}) AS DECIMAL(38,6))"
        columns.append(f"{sequence} AS {SEQUENCE_COLUMN}")
        inexact = _inexact(records, ordered, sequence)
        if inexact is not None:  # before the NULL test: an overflow is NULL too
            invalid.append((f"NOT {tombstone} AND ({inexact})",
                            f"concat('sequence_by {_sql_text(upsert.sequence_by)} = ', CAST(({upsert.sequence_by}) "
                            "AS STRING), ' does not fit DECIMAL(38,6) exactly (more than 32 digits before the point "
                            "or 6 after it): it would tie with its neighbours')"))
        invalid.append((f"NOT {tombstone} AND {sequence} IS NULL",
                        f"'sequence_by {_sql_text(upsert.sequence_by)} is NULL or not a number'"))
    columns += [_q(c) for c in [*extra, *coordinates]]
    columns.append(f"{change} AS {CHANGE_COLUMN}")
    reasons = " ".join(f"WHEN {test} THEN {reason}" for test, reason in invalid)
    why = f"CAST(CASE {reasons} END AS STRING)"
    columns.append(f"{why} AS {INVALID_COLUMN}")
    # The record's bytes go on to the sink only with a row it may quarantine: a change that cannot be
    # applied, or with partition columns any (a value no partition directory can hold), or with an
    # ARRAY or MAP any (a NULL element a table's column may not hold: write/fit.unholdable_values).
    kept = "true" if pipeline.sink.partition_by or _has_collection(row) else f"{why} IS NOT NULL"
    columns += [f"CASE WHEN {kept} THEN {_q(c)} END AS {_q(c)}" for c in record_bytes]
    try:
        shaped = records.selectExpr(*columns)
        shaped.schema  # resolves sequence_by and delete_when
    except Exception as exc:  # Spark's analysis error
        raise UpsertRefused(f"{where}: {str(exc).strip().splitlines()[0]}") from None
    return shaped


def _has_collection(kind) -> bool:
    """Whether a value of Spark type ``kind`` may hold an ARRAY or MAP."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(kind, StructType):
        return any(_has_collection(f.dataType) for f in kind)
    return isinstance(kind, (ArrayType, MapType))


def _inexact(records, sequence_by: str, sequence: str) -> str | None:
    """SQL: a value of ``sequence_by`` that ``sequence`` (its DECIMAL(38,6)) does not hold exactly
    (finer than 6 decimal places, or beyond 32 digits), by the expression's type; None where every
    value fits (integers)."""
    from pyspark.sql.types import DecimalType, DoubleType, FloatType, IntegralType, StringType

    try:
        kind = records.selectExpr(f"({sequence_by}) AS s").schema["s"].dataType
    except Exception:  # not resolved: change_rows names the error
        return None
    value = f"({sequence_by})"
    if isinstance(kind, IntegralType) or (isinstance(kind, DecimalType) and kind.scale <= 6
                                          and kind.precision - kind.scale <= 32):
        return None
    if isinstance(kind, DecimalType):
        return f"{value} IS NOT NULL AND NOT (try_cast({sequence} AS {kind.simpleString()}) <=> {value})"
    if isinstance(kind, (DoubleType, FloatType)):
        return f"{value} IS NOT NULL AND NOT (CAST({sequence} AS DOUBLE) <=> CAST({value} AS DOUBLE))"
    if isinstance(kind, StringType):
        text = f"trim({value})"
        return (f"try_cast({text} AS DOUBLE) IS NOT NULL AND ({sequence} IS NULL OR "
                f"length(regexp_extract({text}, '\\\\.([0-9]*[1-9])0*$', 1)) > 6 OR "
                f"NOT (CAST({sequence} AS DOUBLE) <=> try_cast({text} AS DOUBLE)))")
    return None


def _sql_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")
