"""A reader schema that covers the table's reader and a writer that is ahead of it: what the run
reads into once a record's writer has what the reader lacks (decode/resolve.py, follow).

The writer alone would not do: a topic may hold records of both (an old producer still writing
the version before the subject's latest, or two producers on neighbouring versions), and records
of the reader's writers lacking a field the writer requires would no longer resolve, or stop the
range again at every alternation. The merge is the reader with the writer's additions:

- record: the reader's fields, each merged with the writer's field of that name (or of one of its
  aliases), then the writer's other fields; a field one side lacks is made nullable (``null``
  first) with default null, so records of the other side read it as null (a reader's field with a
  default of its own keeps it, as Avro's resolution would use it);
- enum: the reader's symbols, then the writer's others; union: the reader's branches, each merged
  with the writer's branch that resolves into it (compare.matching_branch), then the writer's
  others; two types of which neither resolves into the other become such a union too;
- array and map: their items and values merged; any other type is the reader's (a writer's type
  promotes into it, or fastavro reports the mismatch record by record).

The result is one standalone schema (JSON text, no references): named types keep their full names,
defined where they first occur and named after that. Whether a table can hold it (a branch added
to a union changes a column's type) is for the table to say (runner.prepare).

Invariant: every record that resolves into the reader, or is written with the writer, resolves
into the merge without losing a field, a symbol or a branch; a merge that could not ensure it (a
named type the two schemas define differently in places) is a ``SchemaError``, never a reader that
stops the range at the same record again.
"""

from __future__ import annotations

import json
from typing import Any

from oncemore.core.columns import SchemaError
from oncemore.decode.avro.compare import compare_schemas, matching_branch
from oncemore.decode.avro.schemas import NAMED, AvroSchema, kind_of


def merge_schemas(reader: AvroSchema, writer: AvroSchema) -> str:
    """The merge of ``reader`` and ``writer`` (module docstring), as standalone Avro schema text."""
    merged = json.dumps(_Merge(reader, writer).both(reader.logical, writer.logical))
    still_ahead, _ = compare_schemas(writer, AvroSchema(merged))
    if still_ahead:
        raise SchemaError(f"the merge of the table's schema and the writer's still lacks {'; '.join(still_ahead)} "
                          "(a named type the two define differently)")
    return merged


class _Merge:
    def __init__(self, reader: AvroSchema, writer: AvroSchema):
        self.reader, self.writer = reader, writer
        self.defined: set[str] = set()  # named types written out already: later occurrences name them

    def both(self, r: Any, w: Any) -> Any:
        """A type the reader's type ``r`` and the writer's ``w`` both resolve into."""
        r, w = self.reader.resolve(r), self.writer.resolve(w)
        if isinstance(r, list) or isinstance(w, list) or not self._match(r, w):
            return self._union(r if isinstance(r, list) else [r], w if isinstance(w, list) else [w])
        kind = kind_of(r)
        if kind in NAMED:
            if r["name"] in self.defined:
                return r["name"]
            self.defined.add(r["name"])
        if kind == "record":
            return {**_attributes(r), "fields": self._fields(r["fields"], w["fields"])}
        if kind == "enum":
            return {**_attributes(r), "symbols": r["symbols"] + [s for s in w["symbols"] if s not in r["symbols"]]}
        if kind == "array":
            return {**_attributes(r), "items": self.both(r["items"], w["items"])}
        if kind == "map":
            return {**_attributes(r), "values": self.both(r["values"], w["values"])}
        return _attributes(r) if isinstance(r, dict) else r  # fixed, or a type the writer's promotes into

    def _match(self, r: Any, w: Any) -> bool:
        return matching_branch(self.writer, self.reader, w, [r]) is not None

    def _fields(self, reader_fields: list, writer_fields: list) -> list:
        by_name = {f["name"]: f for f in writer_fields}
        taken: set[str] = set()
        fields = []
        for field in reader_fields:
            match = next((by_name[n] for n in (field["name"], *field.get("aliases", [])) if n in by_name), None)
            if match is None and "default" not in field:  # the writer's records lack it: read as null
                fields.append({**field, "type": _nullable(self.copy(self.reader, field["type"])), "default": None})
            elif match is None:
                fields.append({**field, "type": self.copy(self.reader, field["type"])})
            else:
                taken.add(match["name"])
                fields.append({**field, "type": self.both(field["type"], match["type"])})
        for field in writer_fields:
            if field["name"] not in taken:
                fields.append({**field, "type": _nullable(self.copy(self.writer, field["type"])), "default": None})
        return fields

    def _union(self, reader_branches: list, writer_branches: list) -> list:
        matched: dict[int, Any] = {}
        added = []
        for branch in writer_branches:
            index = matching_branch(self.writer, self.reader, branch, reader_branches)
            if index is None:
                added.append(branch)
            else:  # several writer branches may promote into one reader branch: its first decides
                matched.setdefault(index, branch)
        merged = [self.both(b, matched[i]) if i in matched else self.copy(self.reader, b)
                  for i, b in enumerate(reader_branches)]
        return merged + [self.copy(self.writer, b) for b in added]

    def copy(self, side: AvroSchema, schema: Any) -> Any:
        """One side's type, its named types defined at their first occurrence in the merge (merged
        there with the other side's type of that name, wherever that one occurs)."""
        schema = side.resolve(schema)
        if isinstance(schema, list):
            return [self.copy(side, b) for b in schema]
        if not isinstance(schema, dict):
            return schema  # a primitive
        kind = kind_of(schema)
        if kind in NAMED:
            if schema["name"] in self.defined:
                return schema["name"]
            reader, writer = (schema, self.writer.named.get(schema["name"])) if side is self.reader else (
                self.reader.named.get(schema["name"]), schema)
            if reader is not None and writer is not None and self._match(reader, writer):
                return self.both(reader, writer)
            self.defined.add(schema["name"])
        copied = _attributes(schema)
        if kind == "record":
            copied["fields"] = [{**f, "type": self.copy(side, f["type"])} for f in schema["fields"]]
        elif kind in ("array", "map"):
            part = "items" if kind == "array" else "values"
            copied[part] = self.copy(side, schema[part])
        return copied


def _nullable(schema: Any) -> list:
    branches = schema if isinstance(schema, list) else [schema]
    return ["null", *(b for b in branches if b != "null")]


def _attributes(schema: dict) -> dict:
    """A parsed type's own attributes, without fastavro's bookkeeping (``__fastavro_parsed``, ...)."""
    return {k: v for k, v in schema.items() if not k.startswith("__")}
