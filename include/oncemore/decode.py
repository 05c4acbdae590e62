"""Kafka records (Arrow batches of KAFKA_RECORD_SCHEMA) to table rows and quarantine rows.

raw keeps key and value bytes. json parses the value with the declared schema using Arrow's
JSON reader a whole batch at a time; a batch with a bad record is bisected until every bad
record stands alone, so a few bad records cost a few extra parses, and each one lands in
quarantine with its bytes, coordinates and the parser's message. Nothing is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from .schema import METADATA_FIELDS, QUARANTINE_SCHEMA, parse_schema

_METADATA_SOURCE = {"_kafka_topic": "topic", "_kafka_partition": "partition", "_kafka_offset": "offset",
                    "_kafka_timestamp": "timestamp"}


@dataclass
class Decoded:
    good: pa.Table  # main table schema
    bad: pa.Table  # QUARANTINE_SCHEMA


class Decoder:
    def __init__(self, format_type: str, schema_ddl: str | None = None):
        self.format_type = format_type
        self.declared = parse_schema(schema_ddl) if format_type == "json" else None
        if self.declared is not None:
            # Parse leniently as nullable; NOT NULL is checked per record so one bad row is quarantined.
            self._parse_schema = pa.schema([f.with_nullable(True) for f in self.declared])
            self._required = [f.name for f in self.declared if not f.nullable]

    def decode(self, records: pa.RecordBatch | pa.Table) -> Decoded:
        records = pa.Table.from_batches([records]) if isinstance(records, pa.RecordBatch) else records
        if self.format_type == "raw":
            return Decoded(_with_metadata(records, records.select(["key", "value"])), _empty_quarantine())
        values = records.column("value").combine_chunks()
        errors: dict[int, str] = {}
        for i in pc.indices_nonzero(pc.is_null(values)).to_pylist():
            errors[i] = "value is null (tombstone), not a JSON object"
        # A blank value parses to no row at all; excluded up front, every other value yields at
        # least one row, so "rows == records" proves one row per record (see _parse_block).
        for i in pc.indices_nonzero(pc.fill_null(pc.match_substring_regex(values, r"^\s*$"), False)).to_pylist():
            errors[i] = "value is empty, not a JSON object"
        candidates = [i for i in range(len(values)) if i not in errors]
        parsed = self._parse(values, candidates, errors)
        if not errors:  # the common case: every record parsed, rows already in order
            return Decoded(_with_metadata(records, parsed.cast(self.declared)), _empty_quarantine())
        good_rows = [i for i in candidates if i not in errors]
        good = _with_metadata(records.take(pa.array(good_rows, pa.int64())), parsed.cast(self.declared))
        bad_rows = sorted(errors)
        bad = _quarantine(records.take(bad_rows), [errors[i] for i in bad_rows])
        return Decoded(good, bad)

    def _parse(self, values: pa.BinaryArray, rows: list[int], errors: dict[int, str]) -> pa.Table:
        """Parses values[rows]; rows that fail go to ``errors``. Returns the good rows' table, in order."""
        if not rows:
            return self._parse_schema.empty_table()
        try:
            return self._parse_block(values, rows)
        except (pa.ArrowInvalid, _NotOneObjectPerRecord) as exc:
            if len(rows) == 1:
                errors[rows[0]] = _message(exc)
                return self._parse_schema.empty_table()
        middle = len(rows) // 2
        left = self._parse(values, rows[:middle], errors)
        right = self._parse(values, rows[middle:], errors)
        return pa.concat_tables([left, right])

    def _parse_block(self, values: pa.BinaryArray, rows: list[int]) -> pa.Table:
        chunk = values.take(rows) if len(rows) != len(values) else values
        # One record per line needs values without raw newlines; a value with one (pretty-printed
        # JSON) is parsed alone with newlines allowed.
        multiline = len(rows) == 1 and b"\n" in chunk[0].as_py()
        if not multiline and pc.any(pc.match_substring(chunk, "\n")).as_py():
            raise _NotOneObjectPerRecord("a value contains a newline")
        text = _join_lines(chunk)
        table = pajson.read_json(
            BytesIO(text),
            read_options=pajson.ReadOptions(use_threads=False, block_size=max(len(text) + 1, 1 << 16)),
            parse_options=pajson.ParseOptions(
                explicit_schema=self._parse_schema, unexpected_field_behavior="ignore", newlines_in_values=multiline
            ),
        )
        if table.num_rows != len(rows):
            raise _NotOneObjectPerRecord(f"value holds {table.num_rows} JSON objects, expected exactly one")
        for name in self._required:
            if table.column(name).null_count:
                raise _NotOneObjectPerRecord(f"column {name!r} is declared NOT NULL but is missing or null")
        return table.select(self._parse_schema.names)


def _join_lines(values: pa.BinaryArray) -> bytes:
    """The values (none null) joined by newlines, straight from the Arrow buffers."""
    count = len(values)
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int32)[values.offset : values.offset + count + 1]
    data = np.frombuffer(values.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    joined = np.empty(len(data) + count, dtype=np.uint8)
    newlines = offsets[1:] - offsets[0] + np.arange(count)
    keep = np.ones(len(joined), dtype=bool)
    keep[newlines] = False
    joined[keep] = data
    joined[newlines] = 10
    return joined.tobytes()


class _NotOneObjectPerRecord(ValueError):
    pass


def _message(exc: Exception) -> str:
    text = str(exc).strip()
    return text if isinstance(exc, _NotOneObjectPerRecord) else f"invalid JSON for the declared schema: {text}"


def _with_metadata(records: pa.Table, columns: pa.Table) -> pa.Table:
    arrays = list(columns.columns) + [records.column(_METADATA_SOURCE[f.name]) for f in METADATA_FIELDS]
    return pa.Table.from_arrays(arrays, schema=pa.schema(list(columns.schema) + METADATA_FIELDS))


def _quarantine(records: pa.Table, errors: list[str]) -> pa.Table:
    columns = pa.table({"key": records.column("key"), "value": records.column("value"),
                        "error": pa.array(errors, pa.string())})
    return _with_metadata(records, columns).cast(QUARANTINE_SCHEMA)


def _empty_quarantine() -> pa.Table:
    return QUARANTINE_SCHEMA.empty_table()
