"""Spark DDL <-> Arrow (oncemore.ddl): every type, nesting, the Delta name rules at every level, errors
naming the path, and the Arrow types being exactly Spark's and Delta's (no casts on the way)."""

from __future__ import annotations

import re

import deltalake
import pyarrow as pa
import pytest
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from oncemore.core.columns import SchemaError
from oncemore.core.ddl import check_json_types, check_names, parse_ddl, to_ddl

UTC = pa.timestamp("us", tz="UTC")


def element(kind: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("element", kind))


def string_map(value: pa.DataType) -> pa.DataType:
    return pa.map_(pa.field("key", pa.string(), nullable=False), pa.field("value", value))


@pytest.mark.parametrize("text, kind", [
    ("TINYINT", pa.int8()), ("byte", pa.int8()), ("SMALLINT", pa.int16()), ("Short", pa.int16()),
    ("INT", pa.int32()), ("integer", pa.int32()), ("BIGINT", pa.int64()), ("long", pa.int64()),
    ("FLOAT", pa.float32()), ("real", pa.float32()), ("DOUBLE", pa.float64()), ("boolean", pa.bool_()),
    ("BINARY", pa.binary()), ("string", pa.string()), ("CHAR(3)", pa.string()), ("varchar( 20 )", pa.string()),
    ("DATE", pa.date32()), ("timestamp", UTC), ("TIMESTAMP_LTZ", UTC), ("timestamp_ntz", pa.timestamp("us")),
    ("DECIMAL(10, 2)", pa.decimal128(10, 2)), ("decimal", pa.decimal128(10, 0)), ("DEC(7)", pa.decimal128(7, 0)),
    ("NUMERIC(38,38)", pa.decimal128(38, 38)), ("decimal(1,0)", pa.decimal128(1, 0)),
    ("ARRAY<INT>", element(pa.int32())), ("array<array<date>>", element(element(pa.date32()))),
    ("MAP<STRING, BIGINT>", string_map(pa.int64())), ("map<string,map<string,binary>>", string_map(string_map(pa.binary()))),
    ("STRUCT<a: INT, b STRING>", pa.struct([("a", pa.int32()), ("b", pa.string())])),
])
def test_every_type_reads_as_sparks_arrow_type(text, kind):
    schema = parse_ddl(f"c {text}")
    assert schema == pa.schema([("c", kind)])
    assert to_arrow_schema(from_arrow_schema(schema), timezone="UTC") == schema


DEEP = ("id BIGINT NOT NULL COMMENT 'the key', "
        "customer STRUCT<name: STRING NOT NULL COMMENT \"shown\", address: STRUCT<zip INT NOT NULL, `a``b-c.d`: DATE>>, "
        "items ARRAY<STRUCT<sku: STRING, price: DECIMAL(10,2), at: ARRAY<TIMESTAMP>>>, "
        "attrs MAP<STRING, STRUCT<n: INT NOT NULL, tags: ARRAY<MAP<STRING, TIMESTAMP_NTZ>>>>, "
        "`order` STRING")


def test_nested_types_to_any_depth_with_not_null_fields():
    schema = parse_ddl(DEEP)
    assert schema == pa.schema([
        pa.field("id", pa.int64(), nullable=False),
        pa.field("customer", pa.struct([
            pa.field("name", pa.string(), nullable=False),
            pa.field("address", pa.struct([pa.field("zip", pa.int32(), nullable=False), pa.field("a`b-c.d", pa.date32())])),
        ])),
        pa.field("items", element(pa.struct([("sku", pa.string()), ("price", pa.decimal128(10, 2)), ("at", element(UTC))]))),
        pa.field("attrs", string_map(pa.struct([
            pa.field("n", pa.int32(), nullable=False), pa.field("tags", element(string_map(pa.timestamp("us"))))]))),
        pa.field("order", pa.string()),
    ])
    # ... and these are the Arrow types Spark converts to and from, and Delta accepts.
    spark = from_arrow_schema(schema)
    assert spark.simpleString() == (
        "struct<id:bigint,customer:struct<name:string,address:struct<zip:int,a`b-c.d:date>>,"
        "items:array<struct<sku:string,price:decimal(10,2),at:array<timestamp>>>,"
        "attrs:map<string,struct<n:int,tags:array<map<string,timestamp_ntz>>>>,order:string>")
    assert not spark["customer"].dataType["address"].dataType["zip"].nullable
    assert to_arrow_schema(spark, timezone="UTC") == schema
    delta = deltalake.Schema.from_arrow(schema)
    assert [f.name for f in delta.fields] == schema.names and not delta.fields[0].nullable


def test_to_ddl_reads_back_to_the_same_schema():
    schema = parse_ddl(DEEP)
    assert parse_ddl(to_ddl(schema)) == schema
    assert to_ddl(schema).startswith("id BIGINT NOT NULL, customer STRUCT<name: STRING NOT NULL, address: STRUCT<zip: INT NOT NULL, `a``b-c.d`: DATE>>")
    assert to_ddl(pa.decimal128(10, 2)) == "DECIMAL(10,2)"
    assert to_ddl(string_map(element(pa.timestamp("us", tz="Europe/Paris")))) == "MAP<STRING, ARRAY<TIMESTAMP>>"
    with pytest.raises(SchemaError, match=re.escape("column 'a.b': Arrow type uint32 has no Spark type")):
        to_ddl(pa.schema([("a", pa.struct([("b", pa.uint32())]))]))


@pytest.mark.parametrize("ddl, message", [
    # The cases schema.parse_schema has always refused, with its messages.
    ("id INT, ID STRING", "duplicate column 'ID' (Delta column names ignore case"),
    ("`e f` INT", "column 'e f': a Delta table without column mapping cannot hold a column name with ' '"),
    ("`a=b` INT, `c;d` INT", "with '='"),
    ("_KAFKA_offset BIGINT", "column '_KAFKA_offset': the _kafka_ prefix is reserved for record metadata"),
    # ... and the same rules at every nesting level.
    ("customer STRUCT<address: STRUCT<Zip: INT, zip: STRING>>", "duplicate column 'customer.address.zip'"),
    ("customer STRUCT<address: STRUCT<`zip code`: INT>>", "column 'customer.address.zip code': a Delta table"),
    ("items ARRAY<STRUCT<`a,b`: INT>>", "column 'items[].a,b': a Delta table without column mapping cannot hold a column name with ','"),
    ("attrs MAP<STRING, STRUCT<`x(1)`: INT>>", "column 'attrs{}.x(1)': a Delta table without column mapping cannot hold a column name with '(' ')'"),
    ("s STRUCT<``: INT>", "column 's.``': a Delta table without column mapping cannot hold a column name that is empty"),
    ("s STRUCT<`a\tb`: INT>", "with '\\t'"),
])
def test_names_delta_cannot_hold_are_refused_at_every_level(ddl, message):
    with pytest.raises(SchemaError) as caught:
        parse_ddl(ddl)
    assert message in str(caught.value)


def test_schemas_from_other_formats_are_held_to_the_same_rules():
    check_names(pa.schema([("id", pa.int64()), ("s", pa.struct([("_kafka_x", pa.int32())]))]))
    with pytest.raises(SchemaError, match=re.escape("duplicate column 'm{}.A' (Delta column names ignore case: 'a'")):
        check_names(pa.schema([("m", string_map(pa.struct([("a", pa.int32()), ("A", pa.int32())])))]))
    with pytest.raises(SchemaError, match="column '_kafka_offset': the _kafka_ prefix is reserved"):
        check_names(pa.schema([("_kafka_offset", pa.int64())]))


def test_the_kafka_prefix_is_reserved_only_for_columns():
    assert parse_ddl("s STRUCT<_kafka_offset: BIGINT>").field("s").type.field("_kafka_offset").type == pa.int64()
    assert parse_ddl("kafka_topic STRING").names == ["kafka_topic"]
    with pytest.raises(SchemaError, match="column '_Kafka_Topic': the _kafka_ prefix is reserved"):
        parse_ddl("_Kafka_Topic STRING")


@pytest.mark.parametrize("ddl, message", [
    ("", "declares no columns"),
    ("a", "column 'a': expected a type at character 2, found the end"),
    ("a INT,", "schema: expected a column name at character 7, found the end"),
    ("a ARRAY<INT", "column 'a': expected '>' at character 12, found the end"),
    ("a MAP<STRING>", "column 'a': expected ',' at character 13, found '>'"),
    ("a ARRAY<INT>>", "expected ',' between columns at character 13, found '>'"),
    ("c STRUCT<address: STRUCT<zip INTEGR>>", "column 'c.address.zip': unsupported type 'INTEGR'"),
    ("c STRUCT<address: STRUCT<zip DECIMAL(39,2)>>", "column 'c.address.zip': DECIMAL(39,2) is out of range"),
    ("c DECIMAL(5,6)", "column 'c': DECIMAL(5,6) is out of range"),
    ("c STRUCT<>", "column 'c': a STRUCT needs at least one field"),
    ("c INT DEFAULT 1", "found 'DEFAULT'"),
    ("c INT NOT", "found 'NOT'"),
    ("c VARCHAR", "column 'c': expected '(' at character 10"),
    ("c INT COMMENT", "column 'c': expected a quoted comment"),
    ("`c INT", "expected a column name at character 1, found '`'"),
])
def test_errors_are_one_line_and_name_the_column(ddl, message):
    with pytest.raises(SchemaError) as caught:
        parse_ddl(ddl)
    text = str(caught.value)
    assert message in text and "\n" not in text and "Traceback" not in text


def test_json_maps_need_string_keys():
    check_json_types(parse_ddl("a MAP<STRING, MAP<STRING, INT>>"))
    with pytest.raises(SchemaError, match=re.escape("column 'a.b[]': JSON object keys are strings, so the MAP needs "
                                                    "STRING keys, not INT")):
        check_json_types(parse_ddl("a STRUCT<b: ARRAY<MAP<INT, STRING>>>"))
    with pytest.raises(SchemaError, match=re.escape("column 'm{}'")):
        check_json_types(parse_ddl("m MAP<STRING, MAP<DATE, STRING>>"))


def test_a_value_field_named_like_the_key_or_the_headers_column_is_refused():
    # A registry schema's: a declared one is refused as the config loads. Either would make every
    # write of the record fail (a table column twice).
    from oncemore.core.columns import decoded_schema

    value = pa.schema([("id", pa.int64()), ("Key", pa.string()), ("headers", pa.string())])
    with pytest.raises(SchemaError, match=r"the value's field 'Key' and the record's key would be two columns of one name"):
        decoded_schema("avro", value, pa.string(), headers=False)
    with pytest.raises(SchemaError, match=r"the value's field 'headers' and the record's headers would be two columns"):
        decoded_schema("avro", value.remove(1), None, headers=True)
    assert decoded_schema("avro", value, None, headers=False).names[:3] == ["id", "Key", "headers"]


def test_a_column_differing_from_the_tables_only_in_case_is_refused_not_added():
    from pyspark.sql.types import LongType, StructField, StructType

    from oncemore.commit.evolution import SchemaChangeRefused, evolve

    table = StructType([StructField("Amount", LongType()), StructField("c", StructType([StructField("Zip", LongType())]))])
    for records, column in ((StructType([StructField("amount", LongType())]), "amount"),
                            (StructType([StructField("c", StructType([StructField("zip", LongType())]))]), "c.zip")):
        with pytest.raises(SchemaChangeRefused, match=rf"column {column} differs from the table's .* only in case"):
            evolve(table, records, "add_columns", "pipeline p")
