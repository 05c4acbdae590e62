"""How a table's schema follows its records' (``sink.schema_evolution``), decided before anything
is read or written.

``add_columns`` (the default): a field of the records that the table lacks, a column or a field
nested in a struct (also inside arrays and maps), is added when it is nullable; the records lacking
a nullable column of the table is fine (its values are NULL). Stopped, naming the column and both
types: a changed type, a nullability the table cannot take (a NOT NULL column the records no longer
fill, a new NOT NULL column a table with rows cannot hold), a new column whose name differs from
one of the table's only in case (Delta's names are case-insensitive), and any change at all with
``fail``.
Stopped before a run reads anything, the run fails; stopped for a writer schema met during a run
(runner.prepare), that writer's records are quarantined with the reason instead: so with ``fail``,
records whose writer would change the table are quarantined and the table stays as it is.

Types are compared as Spark types (a Delta table's schema is Spark's schema JSON), so the
records' Arrow types and the table's agree however delta-rs spells them in Arrow.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import ArrayType, DataType, MapType, StructField, StructType

from oncemore.core.errors import OncemoreError


class SchemaChangeRefused(OncemoreError):
    """The records' schema changed in a way the table cannot follow (or may not: schema_evolution: fail);
    evidence ``problem``: what, naming the column."""


def spark_schema(schema: pa.Schema) -> StructType:
    return from_arrow_schema(schema)


def arrow_schema(schema: StructType) -> pa.Schema:
    """Arrow as PySpark converts it (list items ``element``, map ``key``/``value``, timestamps in UTC)."""
    return to_arrow_schema(schema, timezone="UTC")


def evolve(table: StructType | None, records: StructType, mode: str, where: str) -> tuple[StructType, list[str]]:
    """The table's schema after taking ``records``, and the paths of the fields it gains.

    The merged schema keeps the table's columns in their order, then the new ones; a table that
    does not exist yet simply takes the records' schema."""
    if table is None:
        return records, []
    added: list[str] = []
    merged = _merge(table, records, "", added, where)
    if merged != table and mode == "fail":
        _refuse(where, f"the records' schema adds {', '.join(added)} to the table and sink.schema_evolution is fail",
                added=added)
    return merged, added


def _merge(table: DataType, records: DataType, path: str, added: list[str], where: str) -> DataType:
    if isinstance(table, StructType) and isinstance(records, StructType):
        fields = {f.name: f for f in records.fields}
        merged = []
        for kept in table.fields:
            name = _path(path, kept.name)
            found = fields.pop(kept.name, None)
            if found is None:
                if not kept.nullable:
                    _refuse(where, f"column {name} is NOT NULL in the table and the records no longer have it")
                merged.append(kept)
                continue
            if not kept.nullable and found.nullable:
                _refuse(where, f"column {name} is NOT NULL in the table and nullable in the records")
            merged.append(StructField(kept.name, _merge(kept.dataType, found.dataType, name, added, where),
                                      kept.nullable, kept.metadata))
        kept_names = {kept.name.lower(): kept.name for kept in table.fields}
        for new in fields.values():
            name = _path(path, new.name)
            if new.name.lower() in kept_names:
                _refuse(where, f"column {name} differs from the table's {_path(path, kept_names[new.name.lower()])} "
                               "only in case; Delta's column names are case-insensitive, so it cannot be added beside "
                               "it: a renamed field needs a new table or a deliberate migration")
            if not new.nullable:
                _refuse(where, f"column {name} ({new.dataType.simpleString()} NOT NULL) is new; a table with rows "
                               "cannot gain a NOT NULL column")
            added.append(name)
            merged.append(new)
        return StructType(merged)
    if isinstance(table, ArrayType) and isinstance(records, ArrayType):
        return ArrayType(_merge(table.elementType, records.elementType, path + "[]", added, where), table.containsNull)
    if isinstance(table, MapType) and isinstance(records, MapType) and table.keyType == records.keyType:
        return MapType(table.keyType, _merge(table.valueType, records.valueType, path + "{}", added, where),
                       table.valueContainsNull)
    if table != records:
        _refuse(where, f"column {path}: the table has {table.simpleString()}, the records have "
                       f"{records.simpleString()}; a type change needs a new table or a deliberate migration")
    return table


def _path(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _refuse(where: str, problem: str, **evidence) -> None:
    raise SchemaChangeRefused(f"{where}: {problem}; nothing was written", problem=problem, **evidence)
