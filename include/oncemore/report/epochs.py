"""The main table's schema by version, for ``verify --replay`` (replay.py): the replay decodes every
record with today's reader schema, while a row was written with the table's schema of its commit; a
column (or a struct's field, also inside arrays and maps' values) the table gained after the row's
commit holds NULL in the row. The replay's value is compared as the row's commit could have written
it: those columns and fields NULL. The table's schema by version comes from the metaData actions of
the commit files the log keeps and the snapshot of its first kept version (read only when the schema
changed since); the row's commit is taken as the first covering its coordinates, and the value in
today's schema matches too (a rewinding reset may have ingested the offsets again under a newer
schema).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from oncemore.config.model import Pipeline
from oncemore.plan.ledger import Ledger


def schema_epochs(pipeline: Pipeline, table, schema: pa.Schema) -> list[tuple[int, tuple]]:
    """The main table's schema by version over the log it keeps, as (from version, its shape:
    _shape), oldest first; [] where it is today's since the first kept commit (columns and fields
    are only ever added, so that one comparison says it)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError
    from pyspark.sql.pandas.types import from_arrow_schema

    from oncemore.core.storage import filesystem

    uri, options = pipeline.sink.table_uri, pipeline.sink.storage_options
    kept = Ledger(uri, pipeline.name, options).kept_versions(table)
    today = shape_of(from_arrow_schema(schema))
    if not kept:
        return []
    try:
        first = DeltaTable(uri, version=kept[0], storage_options=dict(options) if options else None)
        base = shape_of(json.loads(first.schema().to_json()))
    except DeltaError:  # not loadable at that version: the first kept metaData stands for it
        base = None
    if base == today:
        return []
    fs, root = filesystem(uri, options)

    def metadata(version: int):
        try:
            with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as stream:
                lines = stream.read().splitlines()
        except FileNotFoundError:  # cleaned up meanwhile: older than the first kept
            return None
        for line in lines:
            if b'"metaData"' in line:
                action = json.loads(line)
                if "metaData" in action:
                    return shape_of(json.loads(action["metaData"]["schemaString"]))
        return None

    with ThreadPoolExecutor(max_workers=min(16, len(kept))) as pool:
        changed = [(v, found) for v, found in zip(kept, pool.map(metadata, kept)) if found is not None]
    if base is None:
        base = changed[0][1] if changed else today
    return [(kept[0], base), *[(v, found) for v, found in changed if v > kept[0]]]


def shape_of(kind) -> tuple | str:
    """The names a type holds, nested (a Spark type, or Delta's schema JSON): ("struct", {name in
    lower case: shape}), ("array", shape), ("map", the values' shape), or "leaf"."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(kind, StructType):
        return ("struct", {f.name.lower(): shape_of(f.dataType) for f in kind.fields})
    if isinstance(kind, ArrayType):
        return ("array", shape_of(kind.elementType))
    if isinstance(kind, MapType):
        return ("map", shape_of(kind.valueType))
    if isinstance(kind, dict):
        if kind.get("type") == "struct":
            return ("struct", {f["name"].lower(): shape_of(f["type"]) for f in kind["fields"]})
        if kind.get("type") == "array":
            return ("array", shape_of(kind["elementType"]))
        if kind.get("type") == "map":
            return ("map", shape_of(kind["valueType"]))
    return "leaf"


def as_written(value, name: str, kind, epochs: list[tuple[int, tuple]], version):
    """The replay's ``value`` of column ``name`` (of today's type ``kind``) as the commit
    ``version`` could have written it: NULL where the table lacked the column then, its struct
    fields the table lacked then NULL; None where every epoch had today's shape."""
    from pyspark.sql import functions as F

    today = shape_of(kind)
    then = [(v, shape[1].get(name.lower()) if isinstance(shape, tuple) else None) for v, shape in epochs]
    if all(old == today for _, old in then):
        return None
    written = [F.lit(None).cast(kind) if old is None else projected(value, old, kind) for _, old in then]
    expression = F.when(version < then[1][0], written[0]) if len(then) > 1 else None
    for i in range(1, len(then) - 1):
        expression = expression.when(version < then[i + 1][0], written[i])
    return written[-1] if expression is None else expression.otherwise(written[-1])


def projected(value, old: tuple | str, kind):
    """``value`` (of Spark type ``kind``) with the struct fields shape ``old`` lacks NULL."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, MapType, StructType

    if old == shape_of(kind):
        return value
    if isinstance(kind, StructType) and isinstance(old, tuple) and old[0] == "struct":
        fields = [(F.lit(None).cast(f.dataType) if f.name.lower() not in old[1]
                   else projected(value.getField(f.name), old[1][f.name.lower()], f.dataType)).alias(f.name)
                  for f in kind.fields]
        return F.when(value.isNull(), F.lit(None).cast(kind)).otherwise(F.struct(*fields))
    if isinstance(kind, ArrayType) and isinstance(old, tuple) and old[0] == "array":
        return F.transform(value, lambda item: projected(item, old[1], kind.elementType))
    if isinstance(kind, MapType) and isinstance(old, tuple) and old[0] == "map":
        return F.transform_values(value, lambda _, item: projected(item, old[1], kind.valueType))
    return value
