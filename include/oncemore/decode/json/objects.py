"""Which JSON values are exactly one JSON object, and why the others are not: not UTF-8, blank,
another JSON value, not valid JSON, or not ending with the object's '}'; with a hint for a value
framed as Confluent's serializers frame one (the pipeline reads Avro, Protobuf or JSON Schema
output as plain JSON).

Invariant: every value that is not exactly one object gets its reason before Arrow's JSON reader
sees the batch; the reader is never handed one.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc

_JSON_KINDS = {type(None): "JSON null", list: "a JSON array", str: "a JSON string", bool: "a JSON boolean",
               int: "a JSON number", float: "a JSON number"}


def not_json_objects(values: pa.BinaryArray) -> dict[int, str]:
    """By index, why a value cannot be exactly one JSON object: not UTF-8 (RFC 8259), blank, another
    JSON value, or not ending with the object's '}'. Null values are not looked at (a null input is a
    null row). Checked before Arrow's reader sees the values: a top-level ``null`` on the first line of
    a block kills the process (pyarrow 26), and the first and last characters keep the reader's objects
    aligned with the values (decoder.py's docstring, "Alignment")."""
    problems = {}
    try:
        values.cast(pa.string())
    except pa.ArrowInvalid:  # rare: find the values at fault one by one
        for i, value in enumerate(values.to_pylist()):
            try:
                value is None or value.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems[i] = f"value is not valid UTF-8 (byte {exc.start}), so not JSON{_framed(value)}"
    # Almost every value starts with '{' and ends with '}': only the others are looked at one by one.
    braced = pc.and_(pc.starts_with(values, "{"), pc.ends_with(values, "}"))
    for i in pc.indices_nonzero(pc.invert(braced)).to_pylist():
        value = values[i].as_py()
        text = value.strip(b" \t\r\n")
        if not text.startswith(b"{"):
            problems.setdefault(i, f"value is {_kind(text)}, not a JSON object{_framed(value)}")
        elif not text.endswith(b"}"):
            problems.setdefault(i, "value does not end with the '}' closing a JSON object (truncated, or text after it)")
    return problems


def _kind(text: bytes) -> str:
    """What a value that is not one JSON object is: another JSON value, or not JSON at all."""
    if not text:
        return "empty"
    try:
        parsed = json.loads(text.decode("utf-8"), parse_constant=_not_json)  # bytes: json would take a BOM
    except ValueError:
        return "not valid JSON"
    return _JSON_KINDS[type(parsed)]


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")  # Python's json takes NaN and Infinity; RFC 8259 does not


def _framed(value: bytes) -> str:
    """A hint for a value that starts as Confluent's serializers frame one (magic byte 0, a 4-byte
    schema ID, here one below 2^24 as registries hand them out, so a stray 0 byte is no hint): the
    pipeline reads Avro, Protobuf or JSON Schema output as plain JSON."""
    if len(value) < 5 or value[0] != 0 or value[1] != 0:
        return ""
    return (f"; it starts as Confluent's wire format does (magic byte 0, schema ID {int.from_bytes(value[1:5], 'big')}):"
            " Avro or Protobuf needs format type avro or protobuf, JSON Schema confluent_framing: true")
