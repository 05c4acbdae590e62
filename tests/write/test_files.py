"""The Parquet files a task writes: which columns are dictionary-encoded (writer.dictionary_columns),
and which rows a table's columns cannot hold (unholdable_values)."""

from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq

from oncemore.commit.share import reason_kind
from oncemore.write.files import DICTIONARY_SAMPLE_ROWS, TableWriter
from oncemore.write.fit import conform, unholdable_values


def dictionary_encoded(path: str) -> dict[str, bool]:
    """Per Parquet column of the file's first row group, whether its values are dictionary-encoded."""
    group = pq.ParquetFile(path).metadata.row_group(0)
    return {group.column(i).path_in_schema: any("DICTIONARY" in e for e in group.column(i).encodings)
            for i in range(group.num_columns)}


def test_a_file_dictionary_encodes_the_columns_whose_values_repeat_and_every_nested_leaf(tmp_path):
    n = 3 * DICTIONARY_SAMPLE_ROWS
    table = pa.table({
        "_kafka_offset": pa.array(range(n), pa.int64()),  # all distinct
        "_kafka_partition": pa.array([0] * n, pa.int32()),
        # Of the first DICTIONARY_SAMPLE_ROWS: 9 in 10 distinct, and just under.
        "amount": pa.array([i % (DICTIONARY_SAMPLE_ROWS * 9 // 10) / 4 for i in range(n)]),
        "customer": pa.array([f"customer-{i % (DICTIONARY_SAMPLE_ROWS * 9 // 10 - 1)}" for i in range(n)]),
        "_kafka_topic": pa.array(["orders"] * n),
        "maybe": pa.array([None] * n, pa.string()),
        "address": pa.array([{"city": "Oslo", "zip": str(i)} for i in range(n)],
                            pa.struct([("city", pa.string()), ("zip", pa.string())])),
        "lines": pa.array([[{"sku": f"s{i}"}] for i in range(n)], pa.list_(pa.struct([("sku", pa.string())]))),
        "attributes": pa.array([[("k", i)] for i in range(n)], pa.map_(pa.string(), pa.int64())),
        "tags": pa.array([[i] for i in range(n)], pa.large_list(pa.int32())),
    })
    writer = TableWriter("main", str(tmp_path), table.schema)
    writer.write(table)
    [written] = writer.close()

    path = str(tmp_path / written.path)
    assert pq.read_table(path).equals(table)
    assert dictionary_encoded(path) == {
        "_kafka_offset": False, "_kafka_partition": True, "amount": False, "customer": True, "_kafka_topic": True,
        "maybe": True,
        # Nested leaves keep Arrow's default, whatever their values.
        "address.city": True, "address.zip": True, "lines.list.element.sku": True,
        "attributes.key_value.key": True, "attributes.key_value.value": True, "tags.list.element": True,
    }


def test_timestamp_partition_values_commit_and_read_back_in_utc(tmp_path):
    """delta-rs refuses a timestamp partition value in the ISO form ('T'); the protocol's form,
    in UTC for a zoned column, commits and reads back as written."""
    import datetime as dt
    import json
    import time

    from deltalake import DeltaTable
    from deltalake.transaction import AddAction

    oslo = dt.timezone(dt.timedelta(hours=1))
    for kind, value, expected in (
        (pa.timestamp("us"), dt.datetime(2024, 1, 2, 3, 4, 5, 6), dt.datetime(2024, 1, 2, 3, 4, 5, 6)),
        (pa.timestamp("us", "UTC"), dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=oslo),
         dt.datetime(2024, 1, 2, 2, 4, 5, tzinfo=dt.timezone.utc)),
    ):
        uri = str(tmp_path / str(kind).replace(" ", "").replace(",", "_"))
        schema = pa.schema([pa.field("at", kind), pa.field("v", pa.string()),
                            pa.field("_kafka_topic", pa.string()), pa.field("_kafka_partition", pa.int32()),
                            pa.field("_kafka_offset", pa.int64())])
        DeltaTable.create(uri, schema, partition_by=["at"])
        writer = TableWriter("main", uri, schema, ("at",))
        writer.write(pa.table({"at": pa.array([value], kind), "v": ["a"], "_kafka_topic": ["t"], "_kafka_partition": pa.array([0], pa.int32()),
                               "_kafka_offset": pa.array([0], pa.int64())}))
        files = writer.close()
        table = DeltaTable(uri)
        table.create_write_transaction([AddAction(f.path, f.size, json.loads(f.partition_values), int(time.time() * 1000),
                                                  True, f.stats) for f in files], mode="append", schema=table.schema(),
                                       partition_by=["at"])
        [row] = DeltaTable(uri).to_pyarrow_table(columns=["at", "v"]).to_pylist()
        assert row["v"] == "a" and row["at"] == expected, (kind, row)


NOT_NULL_INT = pa.field("element", pa.int32(), nullable=False)
HELD = pa.schema([("n", pa.int32()), ("d", pa.decimal128(5, 2)), ("t", pa.timestamp("us", "UTC")),
                  ("s", pa.struct([("m", pa.int32())])), ("l", pa.list_(NOT_NULL_INT)),
                  ("kv", pa.map_(pa.string(), pa.field("value", pa.int32(), nullable=False)))])
WIDER = pa.schema([("n", pa.int64()), ("d", pa.decimal128(10, 3)), ("t", pa.timestamp("ns", "UTC")),
                   ("s", pa.struct([("m", pa.int64())])), ("l", pa.list_(pa.int64())),
                   ("kv", pa.map_(pa.string(), pa.int64()))])


def rows(*changes: dict) -> pa.Table:
    fits = {"n": 1, "d": Decimal("1.250"), "t": 1_000, "s": {"m": 1}, "l": [1], "kv": [("a", 1)]}
    return pa.Table.from_pylist([{**fits, **change} for change in changes], schema=WIDER)


def test_each_row_whose_value_the_tables_column_cannot_hold_is_named_by_column_at_any_depth():
    table = pa.concat_tables([rows({}, {"n": 3_000_000_000}, {"d": Decimal("1.234")}, {}),
                              rows({"d": Decimal("1234.000")}, {"t": 1_001}, {"s": {"m": -3_000_000_000}},
                                   {"s": None}, {"l": [1, 2**40]}, {"l": [None, 1]}, {"kv": [("a", 1), ("b", 2**40)]},
                                   {"kv": [("b", None)]}, {"l": None, "kv": None}, {})])  # two chunks

    problems = unholdable_values(table, HELD)

    assert problems == {
        1: "column 'n': 3000000000 does not fit the table's column type int32",
        2: "column 'd': 1.234 does not fit the table's column type decimal128(5, 2)",
        4: "column 'd': 1234.000 does not fit the table's column type decimal128(5, 2)",
        5: "column 't': '1970-01-01 00:00:00.000001001Z' does not fit the table's column type timestamp[us, tz=UTC]",
        6: "column 's.m': -3000000000 does not fit the table's column type int32",
        8: "column 'l[]': 1099511627776 does not fit the table's column type int32",
        9: "column 'l[]': a NULL, which the table's column (int32 NOT NULL) cannot hold",
        10: "column 'kv{}': 1099511627776 does not fit the table's column type int32",
        11: "column 'kv{}': a NULL, which the table's column (int32 NOT NULL) cannot hold",
    }
    # The rest is written in the table's schema and reads back as sent.
    kept = table.filter(pa.array([i not in problems for i in range(table.num_rows)]))
    written = conform(kept, HELD)
    pq.write_table(written, pa.BufferOutputStream())
    assert written.cast(WIDER).to_pylist() == kept.to_pylist()
    assert unholdable_values(kept, HELD) == {} and unholdable_values(written, HELD) == {}
    # Grouped by kind in a run's report, the value left out.
    assert {reason_kind(p) for p in problems.values()} >= {
        "column 'n': ... does not fit the table's column type int32",
        "column 't': ... does not fit the table's column type timestamp[us, tz=UTC]"}


def test_a_null_list_backed_by_values_and_a_sliced_table_are_judged_and_written_row_by_row():
    # Row 0 a NULL list over [1, NULL] (Arrow allows it), rows 1 and 2 lists; then the table sliced.
    lists = pa.ListArray.from_arrays(pa.array([0, 2, 3, 5], pa.int32()), pa.array([1, None, 3, 4, None], pa.int64()),
                                     mask=pa.array([True, False, False]))
    table = pa.table({"l": lists})
    held = pa.schema([("l", pa.list_(pa.field("element", pa.int64(), nullable=False)))])

    # Row 0's hidden NULL is none of its value (nothing under a NULL list is stored): row 2's is.
    assert unholdable_values(table, held) == {2: "column 'l[]': a NULL, which the table's column (int64 NOT NULL) "
                                                 "cannot hold"}
    stored = conform(table.slice(0, 2), held)
    pq.write_table(stored, pa.BufferOutputStream())
    assert stored.column("l").to_pylist() == [None, [3]]
    assert unholdable_values(table.slice(1, 1), held) == {}
    assert conform(table.slice(1, 1), held).column("l").to_pylist() == [[3]]
    narrower = pa.schema([("l", pa.list_(pa.int32()))])
    assert conform(table, narrower).column("l").to_pylist() == [None, [3], [4, None]]
    assert conform(table.slice(1), narrower).column("l").to_pylist() == [[3], [4, None]]


def test_a_null_struct_whose_fields_are_not_null_is_written_and_a_null_that_shows_is_named():
    # Row 1's struct is NULL (its NOT NULL fields hold nothing), row 2's field is NULL, row 3's id.
    address = pa.struct([("zip", pa.string()), ("geo", pa.struct([("lat", pa.float64())])), ("tags", pa.list_(pa.string()))])
    table = pa.table({"id": [1, 2, 3, None], "addr": pa.array(
        [{"zip": "a", "geo": {"lat": 1.5}, "tags": ["x"]}, None, {"zip": None, "geo": {"lat": 2.0}, "tags": []},
         {"zip": "d", "geo": {"lat": 3.0}, "tags": []}], address)})
    held = pa.schema([pa.field("id", pa.int64(), nullable=False), ("addr", pa.struct([
        pa.field("zip", pa.string(), nullable=False),
        pa.field("geo", pa.struct([pa.field("lat", pa.float64(), nullable=False)]), nullable=False),
        pa.field("tags", pa.list_(pa.string()), nullable=False)]))])

    assert unholdable_values(table, held) == {
        2: "column 'addr.zip': a NULL, which the table's column (string NOT NULL) cannot hold",
        3: "column 'id': a NULL, which the table's column (int64 NOT NULL) cannot hold"}
    stored = conform(table.slice(0, 2), held)
    pq.write_table(stored, pa.BufferOutputStream())  # Parquet's writer refused a NULL under the NULL struct
    assert stored.to_pylist() == [{"id": 1, "addr": {"zip": "a", "geo": {"lat": 1.5}, "tags": ["x"]}},
                                  {"id": 2, "addr": None}]

    # Rows already in the table's type (a JSON decoder's, or Spark's for a transform): the same.
    kind = held.field("addr").type
    addr = pa.StructArray.from_arrays([pa.nulls(1, f.type) for f in kind], fields=list(kind), mask=pa.array([True]))
    exact = pa.table({"id": [2], "addr": addr}, schema=held)
    pq.write_table(conform(exact, held), pa.BufferOutputStream())
    assert conform(exact, held).to_pylist() == [{"id": 2, "addr": None}]
