"""End to end: a record whose decoded value the Delta table's column cannot hold (a table another
writer created: delta-spark makes an ARRAY of non-NULL elements or a MAP of non-NULL values of
``array(...)`` and ``map(...)`` expressions) goes to the quarantine table with a reason naming the
column; the rows that fit are written. A type the table's column does not have, or NULLs where it
holds none, is refused before anything is read (commit/evolution.py). Counted: every (partition, offset) in the table or the
quarantine exactly once."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from conftest import assert_exactly_once, query, read_pairs
from oncemore.commit.evolution import SchemaChangeRefused
from oncemore.core.columns import METADATA_FIELDS
from oncemore.run import runner

pytestmark = pytest.mark.spark

DECLARED = "id BIGINT, customer STRING, scores ARRAY<BIGINT>, attrs MAP<STRING, BIGINT>"
# As delta-spark leaves a table of ``array(...)`` and ``map(...)`` columns: elements and values NOT NULL.
HELD = pa.schema([("id", pa.int64()), ("customer", pa.string()),
                  ("scores", pa.list_(pa.field("element", pa.int64(), nullable=False))),
                  ("attrs", pa.map_(pa.string(), pa.field("value", pa.int64(), nullable=False)))] + METADATA_FIELDS)
# value index -> (record, the reason's column)
UNHOLDABLE = {4: ({"scores": [1, None, 3]}, "scores[]"), 11: ({"attrs": {"a": 1, "b": None}}, "attrs{}"),
              17: ({"scores": [None], "attrs": {"c": None}}, "scores[]")}
SHAPES = {"plain": {}, "transform": {"transform": "SELECT * FROM records"},
          "upsert-local": {"upsert": {"keys": ["id"], "merge": "local"}},
          "upsert-cluster": {"upsert": {"keys": ["id"], "merge": "cluster"}}}


def records(count: int) -> list[tuple[int, bytes, bytes, None]]:
    values = [{"id": i, "customer": f"c{i}", "scores": [i, i + 1], "attrs": {"n": i}} for i in range(count)]
    for i, (change, _) in UNHOLDABLE.items():
        values[i].update(change)
    return [(i % 3, str(i).encode(), json.dumps(v).encode(), None) for i, v in enumerate(values)]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_value_the_tables_column_cannot_hold_is_quarantined_naming_the_column(broker, topic, make_pipeline, spark,
                                                                                  shape):
    sent = records(30)
    produced = broker.produce(topic, sent)
    pipeline = make_pipeline(topic, format={"type": "json", "schema": DECLARED}, **SHAPES[shape])
    write_deltalake(pipeline.sink.table_uri, HELD.empty_table())

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert report.status == "committed"
    assert (report.written, report.quarantined) == (30 - len(UNHOLDABLE), len(UNHOLDABLE))
    main, quarantined = read_pairs(pipeline.sink.table_uri), read_pairs(pipeline.sink.quarantine_uri)
    assert_exactly_once(main + quarantined, produced)
    reasons = {json.loads(value)["id"]: error for value, error in
               query(pipeline.sink.quarantine_uri, "SELECT value, error FROM {table}")}
    assert set(reasons) == set(UNHOLDABLE)
    for i, (_, column) in UNHOLDABLE.items():
        assert f"column '{column}'" in reasons[i] and "NULL" in reasons[i], reasons[i]
    held = DeltaTable(pipeline.sink.table_uri).to_pyarrow_table()
    assert sorted(held.column("id").to_pylist()) == sorted(set(range(30)) - set(UNHOLDABLE))
    assert held.schema.field("scores").type.value_field.nullable is False, "the table keeps its schema"


# table -> (its columns, a record, why the records' schema is refused). An upsert judges value
# columns as nullable (a delete's values are NULL): the second refusal is what keeps an upsert's NULL
# from reaching a NOT NULL column, where the MERGE would fail at every rerun.
REFUSING = {"narrower": ([("id", pa.int32()), ("customer", pa.string())], {"id": 3_000_000_000},
                         "column id: the table has int, the records have bigint"),
            "not-null": ([("id", pa.int64()), pa.field("customer", pa.string(), nullable=False)],
                         {"id": 1, "customer": None},
                         "column customer is NOT NULL in the table and nullable in the records")}


@pytest.mark.parametrize("table", REFUSING)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_column_the_records_cannot_fill_is_refused_before_anything_is_read(broker, topic, make_pipeline, spark,
                                                                             shape, table):
    columns, record, reason = REFUSING[table]
    broker.produce(topic, [(0, b"1", json.dumps(record).encode(), None)])
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT, customer STRING"}, **SHAPES[shape])
    write_deltalake(pipeline.sink.table_uri, pa.schema(columns + METADATA_FIELDS).empty_table())

    with pytest.raises(SchemaChangeRefused, match=reason):
        runner.run(pipeline, spark_factory=lambda: spark)
    assert DeltaTable(pipeline.sink.table_uri).version() == 0 and read_pairs(pipeline.sink.quarantine_uri) == []


@pytest.mark.parametrize("merge", ["local", "cluster"])
def test_a_delete_applies_by_its_key_whatever_value_it_carries(broker, topic, make_pipeline, spark, merge):
    # A delete's values are never stored: a NULL element the table's column cannot hold does not quarantine it.
    pipeline = make_pipeline(topic, format={"type": "json", "schema": DECLARED + ", deleted BOOLEAN"},
                             upsert={"keys": ["id"], "delete_when": "deleted", "merge": merge})
    write_deltalake(pipeline.sink.table_uri, pa.schema([*HELD, pa.field("deleted", pa.bool_())]).empty_table())
    broker.produce(topic, [(0, b"1", json.dumps({"id": 1, "scores": [1, 2], "deleted": False}).encode(), None),
                           (0, b"2", json.dumps({"id": 2, "scores": [3], "deleted": False}).encode(), None)])
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
    broker.produce(topic, [(0, b"1", json.dumps({"id": 1, "scores": [1, None], "deleted": True}).encode(), None),
                           (0, b"2", json.dumps({"id": 2, "scores": [None], "deleted": False}).encode(), None)])

    report = runner.run(pipeline, spark_factory=lambda: spark)

    # The fold: key 1 deleted; key 2's upsert holds a value the table cannot, so it is quarantined and 2 stays as it was.
    assert (report.status, report.quarantined) == ("committed", 1)
    assert DeltaTable(pipeline.sink.table_uri).to_pyarrow_table().select(["id", "scores"]).to_pylist() == [
        {"id": 2, "scores": [3]}]
    assert [json.loads(value)["id"] for value, in query(pipeline.sink.quarantine_uri, "SELECT value FROM {table}")] == [2]


NOT_NULL_ROW = "id BIGINT NOT NULL, name STRING NOT NULL, addr STRUCT<zip: STRING NOT NULL>"


def table_rows(pipeline) -> list[dict]:
    return sorted(DeltaTable(pipeline.sink.table_uri).to_pyarrow_table().select(["id", "name", "addr"]).to_pylist(),
                  key=lambda row: row["id"])


def test_a_kafka_tombstone_deletes_its_key_from_a_table_whose_value_columns_are_not_null(
        broker, topic, make_pipeline, spark):
    # A tombstone's value columns are NULL, a NOT NULL struct field under them too: the records'
    # DataFrame takes NULL at every depth, and the table keeps its NOT NULL columns.
    pipeline = make_pipeline(topic, key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": NOT_NULL_ROW}, upsert={"keys": ["id"]})
    broker.produce(topic, [(0, b'{"id": 1}', b'{"id": 1, "name": "one", "addr": {"zip": "a"}}', None),
                           (0, b'{"id": 2}', b'{"id": 2, "name": "two", "addr": null}', None)])
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
    schema = pa.schema(DeltaTable(pipeline.sink.table_uri).schema().to_arrow())
    assert (schema.field("name").nullable, str(schema.field("addr").type)) == (False, "struct<zip: string not null>")
    broker.produce(topic, [(0, b'{"id": 1}', None, None)])

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.status, report.quarantined) == ("committed", 0)
    assert table_rows(pipeline) == [{"id": 2, "name": "two", "addr": None}]


def test_debezium_creates_and_deletes_apply_to_a_table_whose_columns_are_not_null(broker, topic, make_pipeline, spark):
    # A create's "before" and a delete's "after" are NULL structs whose fields are NOT NULL.
    pipeline = make_pipeline(topic, key={"type": "json", "schema": "id BIGINT"},
                             format={"type": "json", "schema": NOT_NULL_ROW},
                             upsert={"keys": ["id"], "envelope": "debezium"})

    def event(op: str, before, after) -> bytes:
        return json.dumps({"before": before, "after": after, "op": op, "ts_ms": 1}).encode()

    one, two = ({"id": i, "name": n, "addr": {"zip": n[0]}} for i, n in ((1, "one"), (2, "two")))
    broker.produce(topic, [(0, b'{"id": 1}', event("c", None, one), None),
                           (0, b'{"id": 2}', event("c", None, two), None),
                           (0, b'{"id": 1}', event("d", one, None), None)])

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.status, report.quarantined) == ("committed", 0)
    assert table_rows(pipeline) == [two]


@pytest.mark.parametrize("transform", [None, "SELECT * FROM records"])
def test_a_null_struct_whose_fields_are_not_null_is_written(broker, topic, make_pipeline, spark, transform):
    # In Python (no transform) the decoder's rows are in the table's type already; through Spark the
    # records' DataFrame takes NULL anywhere. Either way the NULL struct's fields hold NULLs.
    pipeline = make_pipeline(topic, format={"type": "json", "schema": NOT_NULL_ROW},
                             **({"transform": transform} if transform else {}))
    produced = broker.produce(topic, [(0, None, b'{"id": 1, "name": "one", "addr": {"zip": "a"}}', None),
                                      (0, None, b'{"id": 2, "name": "two", "addr": null}', None)])

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.status, report.quarantined) == ("committed", 0)
    assert table_rows(pipeline) == [{"id": 1, "name": "one", "addr": {"zip": "a"}},
                                    {"id": 2, "name": "two", "addr": None}]
    assert_exactly_once(read_pairs(pipeline.sink.table_uri), produced)


def test_a_delete_applies_to_a_table_whose_value_columns_are_not_null(broker, topic, make_pipeline, spark):
    # The delete's values are dropped before it is staged: the staged change rows take a NULL anywhere.
    pipeline = make_pipeline(topic, format={"type": "json", "schema": "id BIGINT NOT NULL, name STRING NOT NULL, "
                                                                       "deleted BOOLEAN"},
                             upsert={"keys": ["id"], "delete_when": "deleted"})
    broker.produce(topic, [(0, b"1", json.dumps({"id": 1, "name": "one", "deleted": False}).encode(), None),
                           (0, b"2", json.dumps({"id": 2, "name": "two", "deleted": False}).encode(), None)])
    assert runner.run(pipeline, spark_factory=lambda: spark).status == "committed"
    assert DeltaTable(pipeline.sink.table_uri).schema().to_arrow().field("name").nullable is False
    broker.produce(topic, [(0, b"1", json.dumps({"id": 1, "name": "gone", "deleted": True}).encode(), None)])

    report = runner.run(pipeline, spark_factory=lambda: spark)

    assert (report.status, report.quarantined) == ("committed", 0)
    assert DeltaTable(pipeline.sink.table_uri).to_pyarrow_table().select(["id", "name"]).to_pylist() == [
        {"id": 2, "name": "two"}]
