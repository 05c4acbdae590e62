"""Avro schemas as oncemore's tables see them: parsed with their references (named types registered
under other subjects), and their column types following Spark's ``from_avro``.

Mapping (``avro_to_arrow``): a top-level record's fields are the columns (anything else is one
column ``value``); record -> struct, array -> list, map -> map<string, V>, enum -> string, fixed and
bytes -> binary, a union of null and one type -> that type, of exactly int and long -> long, of
exactly float and double -> double, any other union -> struct of ``member0``, ``member1``, ... (its
non-null branches, as Spark names them); logical types: decimal -> DECIMAL(p,s), date -> DATE,
timestamp-millis/micros -> TIMESTAMP (UTC), local-timestamp-millis/micros -> TIMESTAMP_NTZ,
uuid -> string, time-millis/micros -> the int/long they are. Every field is nullable (the rows of
records in errors hold nulls). A schema no table can hold (recursive records, decimals beyond 38
digits, union branches a decoded value cannot tell apart, reserved or case-clashing names) is a
``SchemaError`` naming the field. How a writer's schema stands to the reader's: compare.py.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import fastavro
import pyarrow as pa

from oncemore.core.columns import TIMESTAMP, SchemaError
from oncemore.core.ddl import check_names
from oncemore.decode.registry import Registry, RegistrySchema

# Logical types fastavro would turn into Python objects; they are read as their raw integers and
# strings instead (see decoder.py). Decimals keep fastavro's exact Decimal.
RAW_LOGICAL = {"date", "time-millis", "time-micros", "timestamp-millis", "timestamp-micros",
               "local-timestamp-millis", "local-timestamp-micros", "uuid"}
NAMED = {"record", "enum", "fixed"}
_PRIMITIVE_ARROW = {"boolean": pa.bool_(), "int": pa.int32(), "long": pa.int64(), "float": pa.float32(),
                    "double": pa.float64(), "bytes": pa.binary(), "string": pa.string()}
# (type, logical type) -> column type. Spark has no TIME column type a table can hold: times stay
# the integers they are (milliseconds or microseconds after midnight).
_LOGICAL_ARROW = {("int", "date"): pa.date32(), ("int", "time-millis"): pa.int32(), ("long", "time-micros"): pa.int64(),
                  ("long", "timestamp-millis"): TIMESTAMP, ("long", "timestamp-micros"): TIMESTAMP,
                  ("long", "local-timestamp-millis"): pa.timestamp("us"),
                  ("long", "local-timestamp-micros"): pa.timestamp("us"), ("string", "uuid"): pa.string()}
# What fastavro hands over for each type once raw logical types are stripped: a complex union's
# branch is recognised by it, so two branches may not share one.
_PYTHON_TYPE = {"boolean": bool, "int": int, "long": int, "float": float, "double": float, "bytes": bytes,
                "string": str, "array": list, "map": dict}
# Avro's promotions (writer type -> reader types it resolves into), as fastavro applies them.


class AvroSchema:
    """An Avro schema made ready for reading: parsed with its references (named types registered
    under other subjects), once as written (``logical``) and once with raw logical types stripped
    (``readable``, what fastavro reads with)."""

    def __init__(self, text: str, references: tuple[str, ...] = ()):
        self.named: dict = {}
        readable_named: dict = {}
        try:
            for reference in references:
                raw = json.loads(reference)
                fastavro.parse_schema(raw, self.named)
                fastavro.parse_schema(_strip_raw_logical(raw), readable_named)
            raw = json.loads(text)
            self.logical = fastavro.parse_schema(raw, self.named)
            self.readable = fastavro.parse_schema(_strip_raw_logical(raw), readable_named)
            _defaults_as_read(self.readable, readable_named, set())
            _guard_enum_indexes([self.readable, readable_named], set())
        except Exception as exc:
            raise SchemaError(f"not a valid Avro schema: {exc}") from None
        self.identity = json.dumps([json.loads(t) for t in (text, *references)], sort_keys=True)

    @classmethod
    def registered(cls, registry: Registry, schema: RegistrySchema) -> "AvroSchema":
        """A registry's schema, with the schemas its references name (depth first, once each)."""
        if (schema.schema_type or "AVRO") != "AVRO":
            raise SchemaError(f"a {schema.schema_type} schema, not Avro")
        texts: list[str] = []
        seen: set[tuple[str, int]] = set()

        def collect(references) -> None:
            for reference in references or []:
                if (reference.subject, reference.version) in seen:
                    continue
                seen.add((reference.subject, reference.version))
                found = registry.version(reference.subject, reference.version).schema
                collect(found.references)
                texts.append(found.schema_str)

        collect(schema.references)
        return cls(schema.schema_str, tuple(texts))

    def resolve(self, schema: Any) -> Any:
        """``schema`` with a named type's name replaced by its definition."""
        return self.named.get(schema, schema) if isinstance(schema, str) else schema


class _Symbols:
    """An enum's symbols as fastavro reads them, refusing a negative index (which only garbage bytes
    hold). fastavro takes ``symbols[index]``: a list would give a symbol counted from the end, and
    its compiled reader wraps a negative index around any sequence that has a length, so this one
    has none."""

    def __init__(self, symbols: list[str]):
        self._symbols = list(symbols)

    def __getitem__(self, index: int) -> str:
        if index < 0:
            raise IndexError(f"enum index {index} is negative")
        return self._symbols[index]

    def __contains__(self, symbol: object) -> bool:
        return symbol in self._symbols

    def __iter__(self):
        return iter(self._symbols)

    def __repr__(self) -> str:
        return repr(self._symbols)


def _guard_enum_indexes(parsed: Any, seen: set) -> None:
    """Every enum's symbols in fastavro's parsed schemas (inline and named) as ``_Symbols``."""
    if id(parsed) in seen:
        return
    seen.add(id(parsed))
    if isinstance(parsed, dict):
        if parsed.get("type") == "enum" and isinstance(parsed.get("symbols"), list):
            parsed["symbols"] = _Symbols(parsed["symbols"])
        for value in parsed.values():
            _guard_enum_indexes(value, seen)
    elif isinstance(parsed, list):
        for value in parsed:
            _guard_enum_indexes(value, seen)


def _defaults_as_read(schema: Any, named: dict, seen: set) -> None:
    """Record fields' defaults in a parsed schema made the values fastavro reads for their types:
    fastavro hands a default over as the schema's JSON has it, and JSON writes bytes, fixed and
    decimals as text of code points 0-255 (Avro's rule), not as bytes or Decimal."""
    schema = named.get(schema, schema) if isinstance(schema, str) else schema
    if isinstance(schema, list):
        for member in schema:
            _defaults_as_read(member, named, seen)
    elif isinstance(schema, dict) and schema["type"] == "record" and schema["name"] not in seen:
        seen.add(schema["name"])
        for f in schema["fields"]:
            if "default" in f:
                f["default"] = _default_as_read(f["type"], f["default"], named)
            _defaults_as_read(f["type"], named, seen)
    elif isinstance(schema, dict) and schema["type"] in ("array", "map"):
        _defaults_as_read(schema["items" if schema["type"] == "array" else "values"], named, seen)


def _default_as_read(schema: Any, value: Any, named: dict) -> Any:
    schema = named.get(schema, schema) if isinstance(schema, str) else schema
    if isinstance(schema, list):  # a union's default is of its first branch
        return _default_as_read(schema[0], value, named) if schema else value
    kind = kind_of(schema)
    if kind in ("bytes", "fixed") and isinstance(value, str):
        raw = value.encode("latin-1")
        if logical_of(schema) == "decimal":
            # From text: Decimal arithmetic (scaleb) would round to the context's 28 digits.
            return Decimal(f"{int.from_bytes(raw, 'big', signed=True)}E-{schema.get('scale', 0)}")
        return raw
    if kind == "record" and isinstance(value, dict):
        types = {f["name"]: f["type"] for f in schema["fields"]}
        return {k: _default_as_read(types[k], v, named) if k in types else v for k, v in value.items()}
    if kind == "array" and isinstance(value, list):
        return [_default_as_read(schema["items"], v, named) for v in value]
    if kind == "map" and isinstance(value, dict):
        return {k: _default_as_read(schema["values"], v, named) for k, v in value.items()}
    return value


def avro_to_arrow(schema: str | dict | list) -> pa.Schema:
    """The table schema for an Avro schema (JSON text or parsed JSON, without references)."""
    return table_schema(AvroSchema(schema if isinstance(schema, str) else json.dumps(schema)))


def _strip_raw_logical(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_strip_raw_logical(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    stripped = {k: v for k, v in schema.items() if not (k == "logicalType" and v in RAW_LOGICAL)}
    for key in ("type", "items", "values"):
        if key in stripped:
            stripped[key] = _strip_raw_logical(stripped[key])
    if "fields" in stripped:
        stripped["fields"] = [{**f, "type": _strip_raw_logical(f["type"])} for f in stripped["fields"]]
    return stripped


def kind_of(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, dict):
        return schema["type"] if isinstance(schema["type"], str) else kind_of(schema["type"])
    return schema


def logical_of(schema: Any) -> str | None:
    return schema.get("logicalType") if isinstance(schema, dict) else None


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def table_schema(schema: AvroSchema) -> pa.Schema:
    top = schema.logical
    if kind_of(top) != "record":
        return pa.schema([pa.field("value", _arrow_type(schema, top, "", ()))])
    table = pa.schema(list(_arrow_type(schema, top, "", ())))
    check_names(table)
    return table


def _arrow_type(schema: AvroSchema, avro: Any, path: str, records: tuple[str, ...]) -> pa.DataType:
    avro = schema.resolve(avro)
    kind, logical = kind_of(avro), logical_of(avro)
    where = path or "the value"
    if kind == "union":
        members = union_members(schema, avro)
        if not members:
            raise SchemaError(f"{where}: a union of null alone is always null, which no table column type holds")
        if len(members) == 1:
            return _arrow_type(schema, members[0], path, records)
        merged = merged_union(members)
        if merged:
            return _PRIMITIVE_ARROW[merged]
        _check_branches(schema, members, where)
        return pa.struct([pa.field(f"member{i}", _arrow_type(schema, m, join(path, f"member{i}"), records))
                          for i, m in enumerate(members)])
    if kind == "record":
        if avro["name"] in records:
            raise SchemaError(f"{where}: record {avro['name']} contains itself, which a table column cannot "
                              "(Spark's from_avro refuses recursive schemas too)")
        fields = [pa.field(f["name"], _arrow_type(schema, f["type"], join(path, f["name"]), records + (avro["name"],)))
                  for f in avro["fields"]]
        _check_unique([f.name for f in fields], where)
        return pa.struct(fields)
    if kind == "array":
        return pa.list_(pa.field("element", _arrow_type(schema, avro["items"], path, records)))
    if kind == "map":
        return pa.map_(pa.field("key", pa.string(), nullable=False),
                       pa.field("value", _arrow_type(schema, avro["values"], path, records)))
    if logical == "decimal" and kind in ("bytes", "fixed"):
        precision, scale = avro.get("precision"), avro.get("scale", 0)
        if not isinstance(precision, int) or not 1 <= precision <= 38 or not 0 <= scale <= precision:
            raise SchemaError(f"{where}: decimal({precision},{scale}) is beyond what a table holds (precision 1..38)")
        return pa.decimal128(precision, scale)
    if (kind, logical) in _LOGICAL_ARROW:
        return _LOGICAL_ARROW[kind, logical]
    if kind == "enum":
        return pa.string()
    if kind == "fixed":
        return pa.binary()
    if kind in _PRIMITIVE_ARROW:
        return _PRIMITIVE_ARROW[kind]
    raise SchemaError(f"{where}: Avro type {kind!r} has no table column type (a field that is always null?)")


def union_members(schema: AvroSchema, union: list) -> list:
    """The branches a column holds: all but null (null makes the column nullable, as every column is)."""
    return [m for m in union if schema.resolve(m) != "null"]


def merged_union(members: list) -> str | None:
    """Spark reads a union of exactly int and long as long, of float and double as double."""
    kinds = {m for m in members if isinstance(m, str)}
    if len(members) == 2 and kinds in ({"int", "long"}, {"float", "double"}):
        return "long" if "long" in kinds else "double"
    return None


def branch_key(schema: AvroSchema, member: Any) -> Any:
    """How a decoded value shows which branch of a complex union it came from."""
    member = schema.resolve(member)
    kind = kind_of(member)
    if kind in NAMED:
        return ("named", member["name"])
    if logical_of(member) == "decimal":
        return Decimal
    return _PYTHON_TYPE[kind]


def _check_branches(schema: AvroSchema, members: list, where: str) -> None:
    keys = [branch_key(schema, m) for m in members]
    clashing = sorted({kind_of(schema.resolve(m)) for m, k in zip(members, keys) if keys.count(k) > 1})
    if clashing:
        raise SchemaError(f"{where}: a union of {' and '.join(clashing)} (among others): a decoded value does "
                          "not tell which of them was written, so it cannot be put in its member column")


def _check_unique(names: list[str], where: str) -> None:
    lowered = [n.lower() for n in names]
    twice = sorted({n for n in names if lowered.count(n.lower()) > 1})
    if twice:
        raise SchemaError(f"{where}: fields {', '.join(twice)} differ only in case, which Delta column names cannot")


def has_named_branch(schema: AvroSchema) -> bool:
    """Whether a complex union (one that becomes member columns) has a record, enum or fixed branch."""
    return _has_named_branch(schema, schema.logical, set())


def _has_named_branch(schema: AvroSchema, avro: Any, seen: set) -> bool:
    avro = schema.resolve(avro)
    kind = kind_of(avro)
    if kind == "union":
        members = union_members(schema, avro)
        if len(members) > 1 and any(kind_of(schema.resolve(m)) in NAMED for m in members):
            return True
        return any(_has_named_branch(schema, m, seen) for m in members)
    if kind == "record":
        if avro["name"] in seen:
            return False
        seen.add(avro["name"])
        return any(_has_named_branch(schema, f["type"], seen) for f in avro["fields"])
    if kind in ("array", "map"):
        return _has_named_branch(schema, avro["items" if kind == "array" else "values"], seen)
    return False
