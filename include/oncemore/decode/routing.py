"""Each record's route in a routed pipeline: the value of ``routes.by`` read from the record as it
arrived, before any decoding (each route decodes with a format of its own), for a whole batch at
once.

- ``value.<field>[.<field>...]``: the value read as one JSON object (after Confluent's framing
  when the routes' format has it; the field of its ``payload`` when Kafka Connect's JsonConverter
  wrapped it, ``schemas_enable``) by the json format's own decoder, the path declared STRING: a
  value that is no JSON object, or whose field is not a JSON string, cannot be routed.
- ``headers['name']``: the record's last header of that name (Kafka's ``Headers.lastHeader``), as
  UTF-8 text.
- ``key``: the record's whole key, as UTF-8 text.

Invariant: every record is routed (the index of its route), unrouted (its value names no route, or
it has none: a missing field, a JSON null, no such header, a null key or value) with the reason,
or malformed (its ``by`` cannot be read: not JSON, not a string, not UTF-8) with the reason; a
value a reason quotes is cut to 64 characters, as the decoders' reasons are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

UNROUTED = -1  # the route index of a record no route takes (or whose by cannot be read)
_SHOWN = 64


@dataclass(frozen=True)
class RouterSpec:
    """What a task needs to route records: ``by`` parsed (config/routes.RouteBy's fields), the
    routes' values in order, whether values are Confluent-framed, and whether they come wrapped by
    Kafka Connect's JsonConverter (``wrapped``: the field is the ``payload``'s)."""

    kind: str  # value | header | key
    path: tuple[str, ...]
    name: str | None
    values: tuple[str, ...]
    framed: bool = False
    wrapped: bool = False

    @property
    def by(self) -> str:
        if self.kind == "value":
            return "value." + ".".join(self.path)
        return f"headers['{self.name}']" if self.kind == "header" else "key"

    @classmethod
    def from_dict(cls, data) -> "RouterSpec":
        return cls(data["kind"], tuple(data["path"]), data["name"], tuple(data["values"]), data["framed"],
                   data.get("wrapped", False))


@dataclass
class Routed:
    """A batch's records by route: ``index[i]`` is record i's route (UNROUTED where none takes it);
    ``unrouted`` and ``malformed`` give the reason of each record that is not routed, by row."""

    index: np.ndarray
    unrouted: dict[int, str] = field(default_factory=dict)
    malformed: dict[int, str] = field(default_factory=dict)


class Router:
    """Routes batches of records (columns key, value, headers as read: kafka/batches.py)."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec
        self._values = pa.array(spec.values, pa.string())
        self._decoder = None
        if spec.kind == "value":
            from oncemore.decode.json.decoder import JsonDecoder

            self._path = ("payload", *spec.path) if spec.wrapped else spec.path
            leaf: pa.DataType = pa.string()
            for name in reversed(self._path[1:]):
                leaf = pa.struct([pa.field(name, leaf)])
            self._decoder = JsonDecoder(pa.schema([pa.field(self._path[0], leaf)]))

    def route(self, records: pa.RecordBatch | pa.Table) -> Routed:
        malformed: dict[int, str] = {}
        texts = self._texts(records, malformed)
        index = pc.index_in(texts, value_set=self._values).fill_null(UNROUTED).to_numpy(zero_copy_only=False)
        index = index.astype(np.int64)
        rows = np.flatnonzero(index == UNROUTED)
        if malformed:
            rows = rows[~np.isin(rows, list(malformed))]
        # One reason per value no route takes (the records of one batch share a few), not per record.
        found = texts.take(pa.array(rows, pa.int64())).dictionary_encode()
        reasons = [f"routes.by {self.spec.by} is {_quoted(text)}, which names no route ({', '.join(self.spec.values)})"
                   for text in found.dictionary.to_pylist()]
        missing = f"routes.by {self.spec.by} is missing or null: no route"
        codes = found.indices.fill_null(-1).to_numpy(zero_copy_only=False)
        unrouted = dict(zip(rows.tolist(), (missing if c < 0 else reasons[c] for c in codes.tolist())))
        return Routed(index, unrouted, malformed)

    def _texts(self, records, malformed: dict[int, str]) -> pa.Array:
        """Each record's ``by`` as text (null where it has none, or where it is malformed)."""
        kind = self.spec.kind
        if kind == "key":
            return _utf8(_column(records, "key"), malformed, "the key")
        if kind == "header":
            return _utf8(_last_header(_column(records, "headers"), self.spec.name), malformed,
                         f"header {self.spec.name!r}")
        values = _column(records, "value").cast(pa.binary())
        if self.spec.framed:
            from oncemore.decode.framing import strip_confluent_framing

            values, errors = strip_confluent_framing(values)
            malformed.update({i: f"routes.by {self.spec.by}: {message}" for i, message in errors.items()})
        decoded = self._decoder.decode(values)
        for i, message in decoded.errors.items():
            malformed.setdefault(i, f"routes.by {self.spec.by}: {message}")
        found = decoded.table.column(0).combine_chunks()
        for name in self._path[1:]:
            found = pc.struct_field(found, name)
        if malformed:
            keep = np.ones(len(found), dtype=bool)
            keep[list(malformed)] = False
            found = pc.if_else(pa.array(keep), found, pa.nulls(len(found), pa.string()))
        return found


def _column(records, name: str) -> pa.Array:
    column = records.column(name)
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _last_header(headers: pa.Array, name: str) -> pa.Array:
    """Per record, the value of its last header named ``name`` (null where it has none)."""
    count = len(headers)
    entries = pc.list_flatten(headers)
    parents = pc.list_parent_indices(headers).to_numpy(zero_copy_only=False)
    matching = np.flatnonzero(pc.fill_null(pc.equal(pc.struct_field(entries, "key"), name), False)
                              .to_numpy(zero_copy_only=False))
    chosen = np.full(count, -1, dtype=np.int64)
    chosen[parents[matching]] = matching  # in order: a record's later header overwrites its earlier
    values = pc.struct_field(entries, "value")
    return values.take(pa.array(chosen, mask=chosen < 0)) if count else pa.array([], pa.binary())


def _utf8(column: pa.Array, malformed: dict[int, str], what: str) -> pa.Array:
    """``column``'s bytes as text; a value that is not UTF-8 is null, its reason in ``malformed``."""
    try:
        return column.cast(pa.string())
    except pa.ArrowInvalid:
        texts: list[str | None] = []
        for i, value in enumerate(column.to_pylist()):
            try:
                texts.append(None if value is None else value.decode("utf-8"))
            except UnicodeDecodeError as exc:
                malformed[i] = f"routes.by: {what} is not valid UTF-8 (byte {exc.start})"
                texts.append(None)
        return pa.array(texts, pa.string())


def _quoted(text: str) -> str:
    return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "…")
