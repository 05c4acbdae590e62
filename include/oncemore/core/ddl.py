"""Spark DDL column lists ("id BIGINT NOT NULL, customer STRUCT<address: STRUCT<zip: INT>>") as
Arrow schemas, and back.

The Arrow types are the ones Spark's own Arrow conversion gives (pyspark.sql.pandas.types.to_arrow_type,
session time zone UTC): ARRAY<T> is a list whose nullable item field is named "element", MAP<K, V> a
map of "key" (not null) and "value" (nullable), TIMESTAMP is timestamp[us, tz=UTC] and TIMESTAMP_NTZ
timestamp[us], CHAR(n) and VARCHAR(n) are strings (Spark's from_json reads them as STRING too). So
tables built from these schemas move to and from Spark, and into Delta, without a cast.

Invariant: every schema parse_ddl returns, and every schema check_names passes (whatever format it
comes from), can be the schema of a Delta table without column mapping: at every nesting level,
names are not empty, hold none of ` ,;{}()\\n\\t=`, and differ in more than case (Delta names
ignore case); no top-level name starts with ``_kafka_`` (record metadata). Errors
are one line naming the column by its path: ``customer.address.zip``, ``items[]`` for an ARRAY's
elements, ``attrs{}`` for a MAP's values (``attrs{key}`` for its keys); a name holding ``.[]`` or a
backtick is written in backticks.

sqlglot (30.30) is not used: it accepts what Spark refuses (``ARRAY<INT`` unclosed, ``MAP<STRING>``,
``ARRAY<INT>>``, a trailing comma, DEFAULT and PRIMARY KEY clauses, TEXT/UUID/JSON types), so an
error would surface later and further from the typo.
"""

from __future__ import annotations

import re
from typing import NoReturn

import pyarrow as pa

from oncemore.core.columns import TIMESTAMP, SchemaError

_SIMPLE_TYPES = {
    "TINYINT": pa.int8(), "BYTE": pa.int8(),
    "SMALLINT": pa.int16(), "SHORT": pa.int16(),
    "INT": pa.int32(), "INTEGER": pa.int32(),
    "BIGINT": pa.int64(), "LONG": pa.int64(),
    "FLOAT": pa.float32(), "REAL": pa.float32(),
    "DOUBLE": pa.float64(),
    "BOOLEAN": pa.bool_(),
    "BINARY": pa.binary(),
    "STRING": pa.string(),
    "DATE": pa.date32(),
    "TIMESTAMP": TIMESTAMP, "TIMESTAMP_LTZ": TIMESTAMP,
    "TIMESTAMP_NTZ": pa.timestamp("us"),
}
_DECIMAL_NAMES = {"DECIMAL", "DEC", "NUMERIC"}
_SIZED_STRING_NAMES = {"CHAR", "CHARACTER", "VARCHAR"}
_SUPPORTED = ", ".join([*_SIMPLE_TYPES, "DECIMAL(p,s)", "CHAR(n)", "VARCHAR(n)", "ARRAY<T>", "MAP<K, V>",
                        "STRUCT<name: T, ...>"])
# Spark's DDL names each type by its Arrow type (the first of the synonyms above).
_DDL_NAMES = {kind: name for name, kind in reversed(list(_SIMPLE_TYPES.items()))}

# Characters a Delta table without column mapping cannot hold in a column name (Spark refuses to
# read or write such a table), though Arrow and Parquet take them.
_INVALID_NAME_CHARACTERS = " ,;{}()\n\t="
_RESERVED_PREFIX = "_kafka_"

_TOKEN = re.compile(r"""\s*(?:
    (?P<quoted>`(?:[^`]|``)*`)
  | (?P<text>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<word>\w+)
  | (?P<symbol>[<>(),:])
  | (?P<other>\S))""", re.X)
_PLAIN_NAME = re.compile(r"[^.\[\]`]+")


def parse_ddl(ddl: str) -> pa.Schema:
    """A Spark DDL column list as an Arrow schema (see the module docstring); SchemaError if not."""
    if not ddl.strip():
        raise SchemaError("declares no columns")
    parser = _Parser(ddl)
    fields = [parser.field("", top_level=True)]
    while parser.take(","):
        fields.append(parser.field("", top_level=True))
    parser.expect_end()
    schema = pa.schema(fields)
    check_names(schema)
    return schema


def field_path(parent: str, name: str) -> str:
    """The path of field ``name`` of the struct at ``parent`` ("" for the top level)."""
    shown = name if _PLAIN_NAME.fullmatch(name) else "`" + name.replace("`", "``") + "`"
    return f"{parent}.{shown}" if parent else shown


def to_ddl(schema_or_type: pa.Schema | pa.DataType) -> str:
    """Spark DDL for an Arrow schema ("id BIGINT NOT NULL, name STRING") or type ("DECIMAL(10,2)");
    parse_ddl reads it back to the same schema. SchemaError for a type Spark has no name for."""
    if isinstance(schema_or_type, pa.Schema):
        return ", ".join(_field_ddl(f, field_path("", f.name), " ") for f in schema_or_type)
    return _type_ddl(schema_or_type, "")


def check_json_types(schema: pa.Schema) -> None:
    """SchemaError unless JSON can hold every type: a JSON object's keys are strings, so a MAP read
    from JSON (as from Avro and Protobuf) needs STRING keys."""
    for path, kind in types_within(pa.struct(list(schema)), ""):
        if pa.types.is_map(kind) and not pa.types.is_string(kind.key_type):
            raise SchemaError(f"column {path!r}: JSON object keys are strings, so the MAP needs STRING keys, "
                              f"not {to_ddl(kind.key_type)}")


def check_names(schema: pa.Schema) -> None:
    """SchemaError unless a Delta table without column mapping can hold every name in ``schema``, at
    every nesting level (the module's invariant), whichever format the schema comes from."""
    _check_level(list(schema), "", top_level=True)
    for path, kind in types_within(pa.struct(list(schema)), ""):
        if path and pa.types.is_struct(kind):
            _check_level(list(kind), path, top_level=False)


def types_within(kind: pa.DataType, path: str):
    """(path, type) of ``kind`` and of every type nested in it, outermost first."""
    yield path, kind
    if pa.types.is_struct(kind):
        for field in kind:
            yield from types_within(field.type, field_path(path, field.name))
    elif pa.types.is_map(kind):
        yield from types_within(kind.key_type, path + "{key}")
        yield from types_within(kind.item_type, path + "{}")
    elif pa.types.is_list(kind):
        yield from types_within(kind.value_type, path + "[]")


def _check_level(fields: list[pa.Field], parent: str, top_level: bool) -> None:
    """The names of one struct's fields (the table's columns at the top level)."""
    seen: dict[str, str] = {}
    for field in fields:
        path = field_path(parent, field.name)
        if top_level and field.name.lower().startswith(_RESERVED_PREFIX):
            raise SchemaError(f"column {path!r}: the {_RESERVED_PREFIX} prefix is reserved for record metadata")
        bad = sorted({c for c in field.name if c in _INVALID_NAME_CHARACTERS})
        if bad or not field.name:
            raise SchemaError(f"column {path!r}: a Delta table without column mapping cannot hold a column name "
                              f"{'with ' + ' '.join(repr(c) for c in bad) if bad else 'that is empty'}")
        if field.name.lower() in seen:
            raise SchemaError(f"duplicate column {path!r} (Delta column names ignore case: "
                              f"{seen[field.name.lower()]!r} is there already)")
        seen[field.name.lower()] = field.name


def _field_ddl(field: pa.Field, path: str, separator: str) -> str:
    name = field.name if re.fullmatch(r"\w+", field.name) else "`" + field.name.replace("`", "``") + "`"
    return f"{name}{separator}{_type_ddl(field.type, path)}{'' if field.nullable else ' NOT NULL'}"


def _type_ddl(kind: pa.DataType, path: str) -> str:
    if pa.types.is_struct(kind):
        return f"STRUCT<{', '.join(_field_ddl(f, field_path(path, f.name), ': ') for f in kind)}>"
    if pa.types.is_list(kind) and kind.value_field.nullable:
        return f"ARRAY<{_type_ddl(kind.value_type, path + '[]')}>"
    if pa.types.is_map(kind) and kind.item_field.nullable:
        return f"MAP<{_type_ddl(kind.key_type, path + '{key}')}, {_type_ddl(kind.item_type, path + '{}')}>"
    if pa.types.is_decimal128(kind):
        return f"DECIMAL({kind.precision},{kind.scale})"
    if pa.types.is_timestamp(kind) and kind.unit == "us" and kind.tz is not None:
        return "TIMESTAMP"  # Spark gives its session time zone's name, whichever it is
    if kind in _DDL_NAMES:
        return _DDL_NAMES[kind]
    raise SchemaError(f"column {path!r}: Arrow type {kind} has no Spark type")


class _Parser:
    """Recursive descent over the tokens of a DDL column list."""

    def __init__(self, ddl: str):
        self.ddl = ddl
        self.tokens = [(m.lastgroup, m.group(m.lastgroup), m.start(m.lastgroup)) for m in _TOKEN.finditer(ddl)]
        self.position = 0

    def field(self, parent: str, top_level: bool) -> pa.Field:
        kind, text, _ = self._peek()
        if kind not in ("word", "quoted"):
            self._fail(parent or None, "a column name")
        self.position += 1
        name = text[1:-1].replace("``", "`") if kind == "quoted" else text
        path = field_path(parent, name)
        if not top_level:
            self.take(":")  # Spark accepts STRUCT<name: T> and STRUCT<name T>
        arrow_type = self.data_type(path)
        nullable = not self.take_words("NOT", "NULL")
        if self.take_words("COMMENT"):
            if self._peek()[0] != "text":
                self._fail(path, "a quoted comment")
            self.position += 1  # documentation only: not kept in the schema
        return pa.field(name, arrow_type, nullable=nullable)

    def data_type(self, path: str) -> pa.DataType:
        kind, text, _ = self._peek()
        word = text.upper() if kind == "word" else None
        if word is None:
            self._fail(path, "a type")
        self.position += 1
        if word == "ARRAY":
            self.expect("<", path)
            element = self.data_type(path + "[]")
            self.expect(">", path)
            return pa.list_(pa.field("element", element))
        if word == "MAP":
            self.expect("<", path)
            key = self.data_type(path + "{key}")
            self.expect(",", path)
            value = self.data_type(path + "{}")
            self.expect(">", path)
            return pa.map_(pa.field("key", key, nullable=False), pa.field("value", value))
        if word == "STRUCT":
            self.expect("<", path)
            if self.take(">"):
                raise SchemaError(f"column {path!r}: a STRUCT needs at least one field (Parquet cannot store an empty one)")
            fields = [self.field(path, top_level=False)]
            while self.take(","):
                fields.append(self.field(path, top_level=False))
            self.expect(">", path)
            return pa.struct(fields)
        if word in _DECIMAL_NAMES:
            precision, scale = 10, 0  # Spark's DECIMAL without arguments
            if self.take("("):
                precision = self.number(path)
                scale = self.number(path) if self.take(",") else 0
                self.expect(")", path)
            if not 1 <= precision <= 38 or scale > precision:
                raise SchemaError(f"column {path!r}: DECIMAL({precision},{scale}) is out of range "
                                  "(precision 1 to 38, scale 0 to the precision)")
            return pa.decimal128(precision, scale)
        if word in _SIZED_STRING_NAMES:
            self.expect("(", path)
            self.number(path)
            self.expect(")", path)
            return pa.string()
        if word in _SIMPLE_TYPES:
            return _SIMPLE_TYPES[word]
        raise SchemaError(f"column {path!r}: unsupported type {text!r} (supported: {_SUPPORTED})")

    def number(self, path: str) -> int:
        kind, text, _ = self._peek()
        if kind != "word" or not re.fullmatch("[0-9]+", text):
            self._fail(path, "a number")
        self.position += 1
        return int(text)

    def take(self, symbol: str) -> bool:
        if self._peek()[:2] == ("symbol", symbol):
            self.position += 1
            return True
        return False

    def take_words(self, *words: str) -> bool:
        """Consumes the keywords when all of them come next."""
        ahead = self.tokens[self.position : self.position + len(words)]
        if [(kind, text.upper()) for kind, text, _ in ahead] != [("word", w) for w in words]:
            return False
        self.position += len(words)
        return True

    def expect(self, symbol: str, path: str) -> None:
        if not self.take(symbol):
            self._fail(path, repr(symbol))

    def expect_end(self) -> None:
        if self.position < len(self.tokens):
            self._fail(None, "',' between columns")

    def _peek(self) -> tuple[str, str, int]:
        return self.tokens[self.position] if self.position < len(self.tokens) else ("end", "", len(self.ddl))

    def _fail(self, path: str | None, expected: str) -> NoReturn:
        kind, text, offset = self._peek()
        found = "the end" if kind == "end" else repr(text[:32])
        where = f"column {path!r}" if path else "schema"
        raise SchemaError(f"{where}: expected {expected} at character {offset + 1}, found {found}")
