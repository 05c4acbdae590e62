"""Kafka records (Arrow batches of RECORD_SCHEMA) to table rows and quarantine rows.

raw keeps key and value bytes. json parses the value with the declared schema using Arrow's
JSON reader a whole batch at a time; a batch with a bad record is bisected until every bad
record stands alone, so a few bad records cost a few extra parses, and each one lands in
quarantine with its bytes, coordinates and the reason. Nothing is dropped.

DATE and TIMESTAMP columns are read as text and converted here (Arrow's JSON reader takes dates
only as day numbers): ISO-8601 values, a timestamp without a zone is UTC (the session time zone
oncemore gives Spark). A number is refused, since its unit (s, ms, us) would be a guess. A
record whose Kafka timestamp a microsecond timestamp cannot hold (a producer stamping
nanoseconds) is quarantined too, whatever the format: its timestamp could not be stored. So is
an empty string in a partition column: Delta reads an empty partition value as NULL (protocol,
Partition Value Serialization), so the row would not read back as it was sent.
"""

from __future__ import annotations

import decimal
import re
from dataclasses import dataclass
from io import BytesIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson

from .schema import METADATA_FIELDS, QUARANTINE_SCHEMA, parse_schema

_METADATA_SOURCE = {"_kafka_topic": "topic", "_kafka_partition": "partition", "_kafka_offset": "offset",
                    "_kafka_timestamp": "timestamp"}
_NUMBER_FOR_TEXT = re.compile(r"Column\(/([^)]*)\) changed from string to number")


@dataclass
class Decoded:
    good: pa.Table  # main table schema
    bad: pa.Table  # QUARANTINE_SCHEMA


class Decoder:
    def __init__(self, format_type: str, schema_ddl: str | None = None, partition_by: tuple[str, ...] = ()):
        self.format_type, self.partition_by = format_type, partition_by
        self.declared = parse_schema(schema_ddl) if format_type == "json" else None
        if self.declared is not None:
            # Parse leniently as nullable, temporal columns as text; NOT NULL and temporal values
            # are checked per record so one bad row is quarantined, not the batch.
            self._temporal = {f.name: f.type for f in self.declared if _is_temporal(f.type)}
            self._parse_schema = pa.schema(
                [pa.field(f.name, pa.string() if f.name in self._temporal else f.type) for f in self.declared])
            self._required = [f.name for f in self.declared if not f.nullable]

    def decode(self, records: pa.RecordBatch | pa.Table) -> Decoded:
        records = pa.Table.from_batches([records]) if isinstance(records, pa.RecordBatch) else records
        errors: dict[int, str] = {}
        lost = pc.and_(pc.is_null(records.column("timestamp")), pc.is_valid(records.column("timestamp_ms")))
        for i in pc.indices_nonzero(lost).to_pylist():
            errors[i] = (f"Kafka timestamp {records.column('timestamp_ms')[i].as_py()} ms is beyond what a "
                         "microsecond timestamp can hold (the producer stamped another unit?)")
        if self.format_type == "raw":
            candidates = [i for i in range(records.num_rows) if i not in errors]
            columns = records.select(["key", "value"])
            columns = columns.take(pa.array(candidates, pa.int64())) if errors else columns
        else:
            candidates, columns = self._decode_json(records, errors)
        if not errors:  # the common case: every record good, rows already in order
            return Decoded(_with_metadata(records, columns), _empty_quarantine())
        good = _with_metadata(records.take(pa.array(candidates, pa.int64())), columns)
        bad_rows = sorted(errors)
        bad = _quarantine(records.take(bad_rows), [errors[i] for i in bad_rows])
        return Decoded(good, bad)

    def _decode_json(self, records: pa.Table, errors: dict[int, str]) -> tuple[list[int], pa.Table]:
        """The indices of the records that decode, and their rows (declared schema), in order."""
        values = records.column("value").combine_chunks()
        for i, message in not_json_objects(values).items():
            errors.setdefault(i, message)
        candidates = [i for i in range(len(values)) if i not in errors]
        parsed = self._parse(values, candidates, errors)
        candidates = [i for i in candidates if i not in errors]
        converted, failures = self._convert(parsed)
        for position, message in failures.items():
            errors[candidates[position]] = message
        return [i for i in candidates if i not in errors], converted

    def _parse(self, values: pa.BinaryArray, rows: list[int], errors: dict[int, str]) -> pa.Table:
        """Parses values[rows]; rows that fail go to ``errors``. Returns the good rows' table, in order."""
        if not rows:
            return self._parse_schema.empty_table()
        try:
            return self._parse_block(values, rows)
        except (pa.ArrowInvalid, _NotOneObjectPerRecord) as exc:
            if len(rows) == 1:
                errors[rows[0]] = self._message(exc)
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

    def _convert(self, parsed: pa.Table) -> tuple[pa.Table, dict[int, str]]:
        """Temporal columns from text; returns the converted good rows and, by row, the failures."""
        failures: dict[int, str] = {}
        columns = []
        for field in self.declared:
            column = parsed.column(field.name)
            if field.name in self._temporal:
                column, bad = _to_temporal(field.name, column, field.type)
                for row, message in bad.items():
                    failures.setdefault(row, message)
            if pa.types.is_decimal(field.type):
                for row in _beyond_precision(column, field.type):
                    failures.setdefault(row, f"column {field.name!r}: {column[row].as_py()} does not fit "
                                             f"DECIMAL({field.type.precision},{field.type.scale})")
            if field.name in self.partition_by and pa.types.is_string(field.type):
                for row in pc.indices_nonzero(pc.fill_null(pc.equal(column, ""), False)).to_pylist():
                    failures.setdefault(row, f"column {field.name!r} partitions the table and Delta reads an empty "
                                             "partition value as NULL: the row would not read back as sent")
            columns.append(column)
        table = pa.Table.from_arrays(columns, schema=self.declared)
        if failures:
            keep = np.ones(table.num_rows, dtype=bool)
            keep[list(failures)] = False
            table = table.filter(pa.array(keep))
        return table, failures

    def _message(self, exc: Exception) -> str:
        text = str(exc).strip()
        if isinstance(exc, _NotOneObjectPerRecord):
            return text
        number = _NUMBER_FOR_TEXT.search(text)
        if number and number.group(1) in self._temporal:
            kind = _type_name(self._temporal[number.group(1)])
            return f"column {number.group(1)!r}: a number where {kind} needs an ISO-8601 string (its unit would be a guess)"
        return f"invalid JSON for the declared schema: {text}"


_JSON_KINDS = {b"n": "JSON null", b"[": "a JSON array", b'"': "a JSON string", b"t": "a JSON boolean", b"f": "a JSON boolean"}


def not_json_objects(values: pa.BinaryArray) -> dict[int, str]:
    """By index, why a value cannot be one JSON object: null (a tombstone), blank, not UTF-8 (RFC
    8259), or another JSON value. Checked before Arrow's reader sees the values: a top-level
    ``null`` on the first line of a block crashes it (the process dies, pyarrow 26), and anything
    it took would not be one row of the declared columns. Every value left starts with ``{`` and
    so parses to at least one row: "rows == records" then proves one row per record (_parse_block)."""
    problems = {i: "value is null (tombstone), not a JSON object" for i in pc.indices_nonzero(pc.is_null(values)).to_pylist()}
    try:
        values.cast(pa.string())
    except pa.ArrowInvalid:  # rare: find the values at fault one by one
        for i, value in enumerate(values.to_pylist()):
            try:
                value is None or value.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.setdefault(i, f"value is not valid UTF-8 (byte {exc.start}), so not JSON")
    objects = pc.fill_null(pc.match_substring_regex(values, r"^[ \t\r\n]*\{"), True)
    for i in pc.indices_nonzero(pc.invert(objects)).to_pylist():
        head = values[i].as_py().lstrip(b" \t\r\n")[:1]
        kind = "empty" if not head else _JSON_KINDS.get(head, "a JSON number" if head in b"-0123456789" else "not JSON")
        problems.setdefault(i, f"value is {kind}, not a JSON object")
    return problems


def _beyond_precision(column: pa.ChunkedArray, kind: pa.Decimal128Type) -> list[int]:
    """Rows holding more digits before the point than ``kind`` allows. Arrow's JSON reader checks
    the digits as written and then rescales (1234.5 becomes 1234.50 in a DECIMAL(5,2)), which no
    reader of the table could read back."""
    if kind.precision >= 38:  # the widest Arrow holds: nothing more to check
        return []
    wide = column.cast(pa.decimal128(38, kind.scale))
    limit = pa.scalar(decimal.Decimal(10) ** (kind.precision - kind.scale), pa.decimal128(38, kind.scale))
    return pc.indices_nonzero(pc.fill_null(pc.greater_equal(pc.abs(wide), limit), False)).to_pylist()


def _is_temporal(kind: pa.DataType) -> bool:
    return pa.types.is_date32(kind) or pa.types.is_timestamp(kind)


def _type_name(kind: pa.DataType) -> str:
    if pa.types.is_date32(kind):
        return "DATE"
    return "TIMESTAMP" if kind.tz else "TIMESTAMP_NTZ"


def _to_temporal(name: str, text: pa.ChunkedArray, kind: pa.DataType) -> tuple[pa.ChunkedArray, dict[int, str]]:
    """ISO-8601 text as ``kind``: the column at once, or value by value when some fail."""
    try:
        return pc.cast(text, kind), {}
    except pa.ArrowInvalid:
        pass
    storage = pa.int32() if pa.types.is_date32(kind) else pa.int64()
    values, failures = [], {}
    for row, value in enumerate(text.to_pylist()):
        try:
            values.append(None if value is None else _one_temporal(value, kind).cast(storage).as_py())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            values.append(None)
            failures[row] = f"column {name!r}: {value[:64]!r} is not a valid {_type_name(kind)} (ISO-8601 expected)"
    return pa.chunked_array([pa.array(values, storage).cast(kind)]), failures


def _one_temporal(value: str, kind: pa.DataType) -> pa.Scalar:
    try:
        return pa.scalar(value).cast(kind)
    except pa.ArrowInvalid:
        if not (pa.types.is_timestamp(kind) and kind.tz):
            raise
        # No zone in the text: UTC, the same instant a naive value names.
        return pa.scalar(value).cast(pa.timestamp(kind.unit))


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


def _with_metadata(records: pa.Table, columns: pa.Table) -> pa.Table:
    arrays = list(columns.columns) + [records.column(_METADATA_SOURCE[f.name]) for f in METADATA_FIELDS]
    return pa.Table.from_arrays(arrays, schema=pa.schema(list(columns.schema) + METADATA_FIELDS))


def _quarantine(records: pa.Table, errors: list[str]) -> pa.Table:
    columns = pa.table({"key": records.column("key"), "value": records.column("value"),
                        "error": pa.array(errors, pa.string())})
    return _with_metadata(records, columns).cast(QUARANTINE_SCHEMA)


def _empty_quarantine() -> pa.Table:
    return QUARANTINE_SCHEMA.empty_table()
