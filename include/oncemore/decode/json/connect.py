"""Kafka Connect's JsonConverter wrapper: with ``schemas.enable=true`` (the converter's default) it
writes each value, and each key, as ``{"schema": <the Connect schema>, "payload": <the value>}``.
The json format's ``schemas_enable: true`` reads the payload (``unwrap``) and keeps each record's
schema for what only the schema says (a Decimal's scale, json/decoder.py); without it, a value
written so (exactly those two keys) is refused with the setting named (``wrapped``), never read as
a row of NULLs.

Invariant: every non-null input is either split into its payload and schema, or named in
``errors`` with the reason it is not a wrapper: JsonConverter's own rule, one JSON object with
exactly the keys "schema" and "payload". A payload of JSON null is a null payload (JsonConverter
reads it as a null value). A null input stays null and is no error: JsonConverter writes a record
whose schema and value are both null (Debezium's tombstone) as no bytes at all.

How: JsonConverter writes compact JSON, the schema first: ``{"schema":S,"payload":P}``, and every
record of one schema starts with the same ``{"schema":S,"payload":``. So one value's split (the
first ``,"payload":`` after the prefix) is found and checked (S must parse as one JSON object or
null: a split inside S, should a schema hold that text, is not one), and every value starting with
those same bytes is of that schema, its payload P the rest but the closing brace (an object or
null), which the JSON decoder checks as it checks any value; the batch is compared with each
distinct schema's head at once, not scanned value by value. A value written otherwise (with
whitespace, the payload first) is split alone by Python's JSON scanner, its payload's text kept
exactly as written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


PREFIX = b'{"schema":'
SEPARATOR = b',"payload":'
KEYS = ("schema", "payload")
_MAX_SCHEMAS = 32  # distinct schemas in a batch read together; the values of any others, one by one
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SCANNER = json.JSONDecoder()


@dataclass(frozen=True)
class Unwrapped:
    """``payloads[i]``: input i's payload as written (null for a null input, a JSON null payload,
    or an input in ``errors``); ``schema_index[i]``: its schema's index in ``schemas`` (the distinct
    schemas of the batch, parsed), -1 for none (a null schema, a null input, an error)."""

    payloads: pa.Array
    schema_index: np.ndarray
    schemas: list[dict]
    errors: dict[int, str] = field(default_factory=dict)


class _NotWrapped(ValueError):
    pass


def unwrap(values: pa.Array) -> Unwrapped:
    """The payloads and schemas of ``values`` (binary, nulls allowed), see the module docstring."""
    count = len(values)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    # The payload, too, ends the value: an object's '}' or null (another ending goes the slow way,
    # whose reason names what else the value holds).
    remaining = pc.and_(pc.starts_with(values, PREFIX), pc.or_(pc.ends_with(values, b"}}"), pc.ends_with(
        values, SEPARATOR + b"null}"))).fill_null(False).to_numpy(zero_copy_only=False)
    schema_index = np.full(count, -1, dtype=np.int64)
    schemas: list[dict] = []
    payloads = pa.nulls(count, values.type)
    known = np.zeros(count, dtype=bool)
    groups = 0
    # One schema at a time: a row's schema text, parsed, and every row that starts as it does.
    while remaining.any() and groups < _MAX_SCHEMAS:
        first = int(np.argmax(remaining))
        text = values[first].as_py()
        split = text.find(SEPARATOR, len(PREFIX))
        try:
            schema = json.loads(text[len(PREFIX):split]) if split > 0 else 0
        except ValueError:
            schema = 0  # the split is inside the schema (or it is no JSON): this one goes the slow way
        if schema is not None and not isinstance(schema, dict):
            remaining[first] = False
            continue
        head = text[:split + len(SEPARATOR)]
        group = remaining & pc.starts_with(values, head).fill_null(False).to_numpy(zero_copy_only=False)
        if schema is not None:
            schema_index[group] = len(schemas)
            schemas.append(schema)
        payloads = pc.if_else(pa.array(group), pc.binary_slice(values, start=len(head), stop=-1), payloads)
        known |= group
        remaining &= ~group
        groups += 1
    slow = np.flatnonzero(valid & ~known)
    errors: dict[int, str] = {}
    if len(slow):
        texts = payloads.to_pylist()
        for i in slow.tolist():
            try:
                texts[i], schema = _split(values[i].as_py())
            except _NotWrapped as exc:
                errors[i] = str(exc)
                continue
            if schema is not None:
                schema_index[i] = len(schemas)
                schemas.append(schema)
        payloads = pa.array(texts, values.type)
    # A JSON null payload is a null value, as JsonConverter reads it.
    null_payload = pc.equal(payloads, b"null").fill_null(False)
    if pc.any(null_payload).as_py():
        payloads = pc.if_else(null_payload, pa.nulls(count, values.type), payloads)
    return Unwrapped(payloads, schema_index, schemas, errors)


def wrapped(values: pa.Array) -> list[int]:
    """The indices of values written as JsonConverter's wrapper is (compact, the schema first, and
    by its rule exactly the keys "schema" and "payload"), for a format that does not expect one:
    read as a row they would be a row of NULLs. A value that merely has such keys among others is
    a row like any other."""
    starts = pc.starts_with(values, PREFIX).fill_null(False)
    if not pc.any(starts).as_py():  # the common case: no value even starts as one
        return []
    candidates = pc.indices_nonzero(starts)
    split = pc.find_substring(values.take(candidates), SEPARATOR).fill_null(-1)
    found = []
    for i in candidates.filter(pc.greater_equal(split, len(PREFIX))).to_pylist():
        try:
            _split(values[i].as_py())
        except _NotWrapped:
            continue
        found.append(i)
    return found


def _split(value: bytes) -> tuple[bytes | None, dict | None]:
    """One value's payload text (None for JSON null) and schema, scanned alone."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotWrapped(f"value is not valid UTF-8 (byte {exc.start}), so not JSON") from None
    members: dict[str, tuple[Any, int, int]] = {}
    try:
        at = _WHITESPACE.match(text).end()
        if text[at:at + 1] != "{":
            raise _NotWrapped(_expected(f"value does not start with '{{' (found {text[at:at + 16]!r})"))
        at = _WHITESPACE.match(text, at + 1).end()
        while text[at:at + 1] != "}":
            if members:
                if text[at:at + 1] != ",":
                    raise ValueError(f"expected ',' or '}}' at character {at + 1}")
                at = _WHITESPACE.match(text, at + 1).end()
            if text[at:at + 1] != '"':
                raise ValueError(f"expected a key at character {at + 1}")
            name, at = json.decoder.scanstring(text, at + 1)
            at = _WHITESPACE.match(text, at).end()
            if text[at:at + 1] != ":":
                raise ValueError(f"expected ':' at character {at + 1}")
            begin = _WHITESPACE.match(text, at + 1).end()
            member, at = _SCANNER.raw_decode(text, begin)
            if name in members:
                raise _NotWrapped(_expected(f"value has the key {name[:64]!r} twice"))
            members[name] = (member, begin, at)
            at = _WHITESPACE.match(text, at).end()
        if _WHITESPACE.match(text, at + 1).end() != len(text):
            raise ValueError(f"text after the object at character {at + 2}")
    except _NotWrapped:
        raise
    except (ValueError, RecursionError) as exc:
        raise _NotWrapped(f"value is not valid JSON ({exc})") from None
    if sorted(members) != sorted(KEYS):
        shown = ", ".join(repr(k[:64]) for k in list(members)[:5])
        raise _NotWrapped(_expected(f"value has the keys {shown}" if members else "value is an empty object"))
    schema, (payload, begin, end) = members["schema"][0], members["payload"]
    if schema is not None and not isinstance(schema, dict):
        raise _NotWrapped(_expected("its schema is not a JSON object"))
    return (None if payload is None else text[begin:end].encode()), schema


def _expected(found: str) -> str:
    return (f"{found}: schemas_enable expects Kafka Connect's JsonConverter wrapper, one object with exactly the keys "
            '"schema" and "payload"')


def field_schema(schema: dict | None, reader: tuple[str, ...]) -> dict | None:
    """The Connect schema of the leaf at ``reader`` (field names, ``"[]"`` for an array's elements,
    ``("[]", "value")`` for a map's values) in a record of ``schema``; None where it says nothing."""
    for step in reader:
        if not isinstance(schema, dict):
            return None
        if step == "[]":
            if schema.get("type") == "map":  # the entries' "value" follows
                schema = {"fields": [{**(schema.get("values") or {}), "field": "value"}]}
            else:
                schema = schema.get("items")
        else:
            schema = next((f for f in schema.get("fields") or () if isinstance(f, dict) and f.get("field") == step), None)
    return schema if isinstance(schema, dict) else None
