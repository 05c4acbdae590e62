"""How an Avro writer's schema stands to the table's (reader's) one: what resolution would drop (a
field, enum symbol or union branch the reader lacks: the writer is *ahead*) and what it would
misread (logical types that disagree: the raw values are in another unit), and which reader branch
of a union a writer type resolves into (Avro's rule).

Invariant: a writer found ahead is never decoded into the reader (its records would lose what the
reader lacks): the decoder raises SchemaAhead for it instead.
"""

from __future__ import annotations

from typing import Any

from oncemore.decode.avro.schemas import NAMED, RAW_LOGICAL, AvroSchema, join, kind_of, logical_of

_PROMOTIONS = {"int": {"long", "float", "double"}, "long": {"float", "double"}, "float": {"double"},
               "string": {"bytes"}, "bytes": {"string"}}


def matching_branch(writer: AvroSchema, reader: AvroSchema, w: Any, candidates: list) -> int | None:
    """The index of the first reader branch a writer type resolves into (Avro's rule for unions), or None."""
    w = writer.resolve(w)
    for index, candidate in enumerate(candidates):
        r = reader.resolve(candidate)
        kw, kr = kind_of(w), kind_of(r)
        if kw in NAMED or kr in NAMED:
            if kw == kr and _short(w["name"]) in {_short(r["name"]), *map(_short, r.get("aliases", []))}:
                return index
        elif kw == kr or kr in _PROMOTIONS.get(kw, ()):
            return index
    return None


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def compare_schemas(writer: AvroSchema, reader: AvroSchema) -> tuple[list[str], list[str]]:
    """Where the writer has what the reader lacks (ahead: resolution would drop it) and where their
    logical types disagree (unresolvable). Other mismatches are left to fastavro, record by record."""
    ahead: list[str] = []
    unresolvable: list[str] = []
    _compare(writer, reader, writer.logical, reader.logical, "", ahead, unresolvable, set())
    return ahead, unresolvable


def _compare(writer: AvroSchema, reader: AvroSchema, w: Any, r: Any, path: str,
             ahead: list[str], unresolvable: list[str], seen: set) -> None:
    w, r = writer.resolve(w), reader.resolve(r)
    where = path or "the value"
    if isinstance(w, list) or isinstance(r, list):
        branches = r if isinstance(r, list) else [r]
        for branch in (w if isinstance(w, list) else [w]):
            target = matching_branch(writer, reader, branch, branches)
            if target is None:
                if isinstance(w, list):
                    ahead.append(f"{where} may hold {_describe(writer.resolve(branch))}")
            else:
                _compare(writer, reader, branch, branches[target], path, ahead, unresolvable, seen)
        return
    kw, kr = kind_of(w), kind_of(r)
    lw, lr = logical_of(w), logical_of(r)
    if (lw in RAW_LOGICAL or lr in RAW_LOGICAL) and lw != lr:
        unresolvable.append(f"{where} is {lw or kw} in the writer, {lr or kr} in the table")
    elif lw == lr == "decimal" and w.get("scale", 0) != r.get("scale", 0):
        unresolvable.append(f"{where} has decimal scale {w.get('scale', 0)} in the writer, "
                            f"{r.get('scale', 0)} in the table")
    if kw != kr:
        return  # a promotion, or a mismatch fastavro reports record by record
    if kw == "record":
        if (w["name"], r["name"]) in seen:
            return
        seen.add((w["name"], r["name"]))
        by_name = {f["name"]: f for f in r["fields"]}
        for field in r["fields"]:
            for alias in field.get("aliases", []):
                by_name.setdefault(alias, field)
        for field in w["fields"]:
            target = by_name.get(field["name"])
            if target is None:
                ahead.append(f"field {join(path, field['name'])}")
            else:
                _compare(writer, reader, field["type"], target["type"], join(path, field["name"]),
                         ahead, unresolvable, seen)
    elif kw == "array":
        _compare(writer, reader, w["items"], r["items"], path, ahead, unresolvable, seen)
    elif kw == "map":
        _compare(writer, reader, w["values"], r["values"], path, ahead, unresolvable, seen)
    elif kw == "enum":
        missing = [s for s in w["symbols"] if s not in r["symbols"]]
        if missing:
            ahead.append(f"{where} symbols {', '.join(missing)}")


def _describe(schema: Any) -> str:
    kind = kind_of(schema)
    return f"{kind} {schema['name']}" if kind in NAMED else kind
