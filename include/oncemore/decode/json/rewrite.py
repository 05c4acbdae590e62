"""JSON values rewritten, one by one with Python's json module, into text Arrow's JSON reader reads
as the parse type (json/types.py) where it cannot read the value as written: MAP objects become lists
of {"key", "value"} entries (the reader has no map type), undeclared fields are left out (a number
beyond a double's range there would stop the reader), numbers stay as written. json/decoder.py uses
it for every value of a schema with a MAP, and for a value the reader refuses for such a number.

Invariant: the text reads as the value would under the declared schema, or ``Refused`` names the
path and the reason; a value of another kind than declared is rewritten as an empty one of its own
kind, so the reader names its path.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Mapping

import pyarrow as pa

from oncemore.core.ddl import field_path, to_ddl
from oncemore.decode.json.readings import Reading


class Refused(ValueError):
    """A value the rewrite refuses; the message names the path."""


class _Number(str):
    """A JSON number as written (NaN and Infinity too)."""

class _Object(list):
    """A JSON object's (key, value) pairs, in order, duplicates kept."""

# Python's json module, keeping what the rewrite needs: numbers as written, objects' keys in order.
_LOADER = json.JSONDecoder(object_pairs_hook=_Object, parse_int=_Number, parse_float=_Number, parse_constant=_Number)
_quote = json.encoder.encode_basestring_ascii

def _rewriter(kind: pa.DataType, path: str, reader: tuple[str, ...], readings: Mapping[tuple[str, ...], Reading]):
    """A function giving a value from _LOADER as JSON text for the parse type of ``kind``: MAP objects
    as lists of {"key", "value"} objects, undeclared fields left out, numbers as written. A value of
    another kind than declared becomes an empty one of its own kind, which the reader refuses at its
    path; a JSON array for a MAP is refused here (the reader would take it for entries). A leaf of
    ``readings`` keeps an object as the object its reading reads (a VariableScaleDecimal)."""
    if reader in readings and "object" in readings[reader].kinds:
        as_object = _rewriter(readings[reader].kinds["object"], path, reader, {})
        as_scalar = _rewrite_any(kind, path, None, None)
        return lambda value: as_object(value) if type(value) is _Object else as_scalar(value)
    if pa.types.is_struct(kind):
        fields = {f.name: (_quote(f.name) + ":", _rewriter(f.type, field_path(path, f.name), (*reader, f.name), readings))
                  for f in kind}

        def struct_text(pairs: _Object) -> str:
            return "{" + ",".join([fields[key][0] + fields[key][1](item) for key, item in pairs if key in fields]) + "}"

        return _rewrite_any(kind, path, _Object, struct_text)
    if pa.types.is_map(kind):
        item_text = _rewriter(kind.item_type, path + "{}", (*reader, "[]", "value"), readings)

        def entries_text(pairs: _Object) -> str:
            if len({key for key, _ in pairs}) < len(pairs):
                twice = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
                raise Refused(f"column {path!r}: key {twice[:64]!r} appears twice (Spark refuses duplicate map keys)")
            return "[" + ",".join(['{"key":' + _quote(key) + ',"value":' + item_text(item) + "}"
                                   for key, item in pairs]) + "]"

        return _rewrite_any(kind, path, _Object, entries_text)
    if pa.types.is_list(kind):
        element_text = _rewriter(kind.value_type, path + "[]", (*reader, "[]"), readings)

        def list_text(elements: list) -> str:
            return "[" + ",".join([element_text(element) for element in elements]) + "]"

        return _rewrite_any(kind, path, list, list_text)
    return _rewrite_any(kind, path, None, None)

def _rewrite_any(kind: pa.DataType, path: str, container: type | None, container_text):
    """_rewriter's function for ``kind``, given how it writes the JSON container ``kind`` is read from."""

    def rewrite(value) -> str:
        if type(value) is str:
            return _quote(value)
        if type(value) is _Number:
            if value[-1].isdigit() and math.isinf(float(value)):
                raise Refused(f"column {path!r}: {value[:64]} does not fit {to_ddl(kind)}")
            return value
        if type(value) is container:
            return container_text(value)
        if value is None or value is True or value is False:
            return json.dumps(value)
        if type(value) is list and pa.types.is_map(kind):
            raise Refused(f"column {path!r}: expected {to_ddl(kind)}, found a JSON array")
        return "{}" if type(value) is _Object else "[]"

    return rewrite


class Rewriter:
    """Rewrites values of the ``declared`` struct (module docstring); ``readings``: its leaves read
    from several JSON kinds (json/readings.py), whose objects are kept."""

    def __init__(self, declared: pa.StructType, readings: Mapping[tuple[str, ...], Reading]):
        self._rewrite = _rewriter(declared, "", (), readings)

    def text(self, value: str) -> str:
        """``value`` (one JSON text) as the parse type reads it; Refused if it cannot be."""
        try:
            return self._rewrite(_LOADER.decode(value))
        except json.JSONDecodeError as exc:
            raise Refused(f"invalid JSON: {exc.msg} at character {exc.pos + 1}") from None
        except RecursionError:
            raise Refused("invalid JSON: nested too deeply") from None
