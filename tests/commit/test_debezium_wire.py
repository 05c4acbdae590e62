"""Change streams as Debezium's connectors send them, ingested end to end on the real broker and
counted: every record of the committed ranges in the table or the quarantine table exactly once,
and the table equal to the fold of the events key by key (test_upsert.py's helpers). The events are
written as the connectors write them: the field types of each connector's ``source`` block, Kafka
Connect's JsonConverter wrapper, Debezium's precise decimals; each test cites its reference."""

from __future__ import annotations

import base64
import json
from decimal import Decimal

import pytest

from conftest import assert_exactly_once, oncemore_commits, query, read_coordinates
from devtools.changefeed import (ChangeEvent, debezium_events, fold, produce, project, read_back, source_state,
                                 table_state)
from oncemore.core.errors import QuarantineExceeded
from oncemore.run.runner import run
from test_upsert import COLUMNS, ROW, accounted, assert_folded, debezium, envelope, key


def row(i: int, name: str = "n") -> dict:
    return {"id": i, "name": name, "balance": i}


def quarantined(pipeline) -> dict[tuple[int, int], tuple[bytes | None, bytes | None, str]]:
    """The quarantine table's rows by (partition, offset): (key, value, error)."""
    found = query(pipeline.sink.quarantine_uri, "SELECT _kafka_partition, _kafka_offset, key, value, error FROM {table}")
    assert len(found) == len({(p, o) for p, o, *_ in found}), "a record quarantined twice"
    return {(p, o): (k, v, e) for p, o, k, v, e in found}


def test_a_change_that_cannot_be_applied_is_quarantined_with_its_records_key_and_value(
        spark, broker, topic, make_pipeline):
    # Each of these is quarantined by shape/changes.py after decoding: the quarantine row holds the
    # record's own bytes, as an append's quarantine row does (decode/rows.py), not the shaped row.
    bad = {
        "unknown op": (0, key(2), envelope("x", row(2), lsn=11)),
        "null key column": (1, key(3), envelope("u", {"id": None, "name": "no key", "balance": 0}, lsn=12)),
        "null sequence": (1, key(4), envelope("u", row(4), lsn=None)),
        "a delete naming no key": (2, None, envelope("d", before={"id": None, "name": "x", "balance": 0}, lsn=13)),
    }
    good = [(0, key(1), envelope("c", row(1), lsn=10)), (2, key(5), envelope("c", row(5), lsn=14)),
            (2, key(1), None)]  # under sequence_by a tombstone is counted, not applied
    broker.produce(topic, [(p, k, v, None) for p, k, v in [*good, *bad.values()]])
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn")
    run(pipeline, spark_factory=lambda: spark)

    records = {(r[1], r[2]): (r[3], r[4]) for r in read_back(broker.bootstrap_servers, topic)}
    held = quarantined(pipeline)
    expected = {coordinates: kv for coordinates, kv in records.items() if kv in [(k, v) for _, k, v in bad.values()]}
    assert len(expected) == len(bad)
    assert {c: (k, v) for c, (k, v, _) in held.items()} == expected
    assert sorted(e for *_, e in held.values()) == ["Debezium op 'x' is not c, r, u, d or t", "key column id is NULL",
                                                   "key column id is NULL",
                                                   "sequence_by source.lsn is NULL or not a number"]

    def applicable_lsn(value):
        valid = value["op"] in "crud" and isinstance(value["source"]["lsn"], int) and (
            value["after"] or value["before"])["id"] is not None
        return value["source"]["lsn"] if valid else None

    assert_folded(pipeline, broker, topic, applicable_lsn, skip_invalid=True)
    assert accounted(pipeline) == len(records)


def test_a_change_a_partition_directory_cannot_hold_is_quarantined_with_its_records_key_and_value(
        spark, broker, topic, make_pipeline):
    # Partitioned by its key, a table cannot hold the key "" (Delta reads an empty partition value
    # as NULL): the sink quarantines that change, which decoded and is applicable, with its bytes too.
    records = [(0, b'{"region":"north"}', b'{"region":"north","v":1}'), (0, b'{"region":""}', b'{"region":"","v":2}'),
               (1, b'{"region":"south"}', b'{"region":"south","v":3}')]
    broker.produce(topic, [(p, k, v, None) for p, k, v in records])
    pipeline = make_pipeline(topic, name="regions", key={"type": "json", "schema": "region STRING"},
                             format={"type": "json", "schema": "region STRING, v BIGINT"},
                             upsert={"keys": ["region"]}, sink={"partition_by": ["region"]})
    run(pipeline, spark_factory=lambda: spark)
    assert query(pipeline.sink.table_uri, "SELECT region, v FROM {table} ORDER BY region") == [("north", 1), ("south", 3)]
    held = quarantined(pipeline)
    assert {c: (k, v) for c, (k, v, _) in held.items()} == {(0, 1): records[1][1:]}
    assert accounted(pipeline) == len(records)

# Kafka Connect's JsonConverter with schemas.enable=true (its default) wraps every key and value as
# {"schema": ..., "payload": ...}, compact, the schema first; a schema is {"type", "fields" (a
# struct's), "optional", "name", "version", "parameters", "default"}, a struct field's "field" last
# (apache/kafka connect/json JsonConverter.asJsonSchema and convertToJsonWithEnvelope). A record
# whose schema and value are both null, Debezium's tombstone, is written as a null value
# (JsonConverter.fromConnectData). The envelope's schema is the one Debezium's PostgreSQL connector
# documents for a create event (debezium/debezium, documentation/modules/ROOT/pages/connectors/
# postgresql.adoc, "create events"), the key's its "Key" struct of the primary key.
def connect_field(field: str, kind: str, optional: bool = True, **more) -> dict:
    return {"type": kind, "optional": optional, **more, "field": field}


ROW_FIELDS = [connect_field("id", "int64", False), connect_field("name", "string"), connect_field("balance", "int64")]
KEY_SCHEMA = {"type": "struct", "fields": ROW_FIELDS[:1], "optional": False, "name": "shop.public.accounts.Key"}
VALUE_SCHEMA = {"type": "struct", "fields": ROW_FIELDS, "optional": True, "name": "shop.public.accounts.Value"}
SOURCE_SCHEMA = {"type": "struct", "fields": [
    connect_field("version", "string", False), connect_field("connector", "string", False),
    connect_field("name", "string", False), connect_field("ts_ms", "int64", False),
    connect_field("snapshot", "string", name="io.debezium.data.Enum", version=1,
                  parameters={"allowed": "true,first,first_in_data_collection,last_in_data_collection,last,false,incremental"},
                  default="false"),
    connect_field("db", "string", False), connect_field("sequence", "string"), connect_field("ts_us", "int64"),
    connect_field("ts_ns", "int64"), connect_field("schema", "string", False), connect_field("table", "string", False),
    connect_field("txId", "int64"), connect_field("lsn", "int64"), connect_field("xmin", "int64")],
    "optional": False, "name": "io.debezium.connector.postgresql.Source", "field": "source"}
TRANSACTION_SCHEMA = {"type": "struct", "fields": [
    connect_field("id", "string", False), connect_field("total_order", "int64", False),
    connect_field("data_collection_order", "int64", False)], "optional": True, "name": "event.block", "version": 1,
    "field": "transaction"}
ENVELOPE_SCHEMA = {"type": "struct", "fields": [
    {**VALUE_SCHEMA, "field": "before"}, {**VALUE_SCHEMA, "field": "after"}, SOURCE_SCHEMA,
    connect_field("op", "string", False), connect_field("ts_ms", "int64"), TRANSACTION_SCHEMA],
    "optional": False, "name": "shop.public.accounts.Envelope", "version": 2}


def connect_wrapped(schema: dict, payload) -> dict:
    return {"schema": schema, "payload": payload}


def payloads(records):
    """Records read back with their JsonConverter wrappers taken off (what the reference fold reads)."""
    def unwrapped(data):
        return None if data is None else json.dumps(json.loads(data)["payload"]).encode()

    return [(t, p, o, unwrapped(k), unwrapped(v)) for t, p, o, k, v in records]


def test_debezium_through_jsonconverter_with_schemas_lands_the_fold(spark, broker, topic, make_pipeline):
    events = debezium_events(keys=30, changes=240, seed=11)
    wrapped = [ChangeEvent(connect_wrapped(KEY_SCHEMA, e.key),
                           None if e.value is None else connect_wrapped(ENVELOPE_SCHEMA, e.value), e.lsn) for e in events]
    produce(broker.bootstrap_servers, topic, wrapped, "key")
    pipeline = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT", "schemas_enable": True},
                             format={"type": "json", "schema": ROW, "schemas_enable": True},
                             upsert={"keys": ["id"], "envelope": "debezium", "sequence_by": "source.lsn"})
    run(pipeline, spark_factory=lambda: spark)

    records = read_back(broker.bootstrap_servers, topic)
    expected = fold(payloads(records), "debezium", ("id",), sequence=lambda value: value["source"]["lsn"])
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert found.keys() == expected.keys() and expected
    assert all({c: found[k][c] for c in row} == row for k, row in expected.items())
    assert project(found, COLUMNS) == source_state(events)
    assert quarantined(pipeline) == {}
    assert accounted(pipeline) == len(records)


def test_rows_through_jsonconverter_with_schemas_append_on_both_paths_and_upsert(spark, broker, topic, make_pipeline):
    # Debezium's ExtractNewRecordState (delete.tombstone.handling.mode=rewrite-with-tombstone) sends
    # the row itself with a __deleted field ("true" for a delete, the row as it was), then the
    # tombstone; through JsonConverter with schemas.enable=true (debezium/debezium documentation/
    # modules/ROOT/pages/transformations/event-flattening.adoc).
    rows = {**VALUE_SCHEMA, "fields": [*ROW_FIELDS, connect_field("__deleted", "string")], "name": "shop.public.accounts.Value"}
    events = []
    for e in debezium_events(keys=20, changes=120, seed=12):
        row = None if e.value is None else (
            {**e.value["before"], "__deleted": "true"} if e.value["op"] == "d" else {**e.value["after"], "__deleted": "false"})
        events.append(ChangeEvent(connect_wrapped(KEY_SCHEMA, e.key), None if row is None else connect_wrapped(rows, row),
                                  e.lsn))
    produce(broker.bootstrap_servers, topic, events, "key")
    records = read_back(broker.bootstrap_servers, topic)
    wire = {"type": "json", "schema": ROW + ", __deleted STRING"}
    settings = dict(key={"type": "json", "schema": "id BIGINT", "schemas_enable": True},
                    format={**wire, "schemas_enable": True})
    upserted = make_pipeline(topic, name="rows_upsert", **settings, upsert={"keys": ["id"], "delete_when": "__deleted = 'true'"})
    fused = make_pipeline(topic, name="rows_append", **settings)
    shaped = make_pipeline(topic, name="rows_shaped", **settings, transform="SELECT *, upper(name) AS shout FROM records")
    unset = make_pipeline(topic, name="rows_unset", format=wire)
    assert not fused.shapes_in_spark and shaped.shapes_in_spark
    for pipeline in (upserted, fused, shaped):
        run(pipeline, spark_factory=lambda: spark)
    # Without schemas_enable every wrapped value is refused naming the setting (read as a row, it
    # would be a row of NULLs: no declared column is in the wrapper), and the batch with them.
    with pytest.raises(QuarantineExceeded, match=r"\d+ x value is Kafka Connect's JsonConverter wrapper .* set "
                                                 r"format.schemas_enable: true to read its payload"):
        run(unset, spark_factory=lambda: spark)
    assert oncemore_commits(unset.sink.table_uri) == oncemore_commits(unset.sink.quarantine_uri) == []
    unset = make_pipeline(topic, name="rows_unset", format=wire, quarantine={"max_fraction": 1})
    run(unset, spark_factory=lambda: spark)
    assert accounted(upserted) == len(records)
    for pipeline in (fused, shaped, unset):  # appends: every record in the table or the quarantine, once
        assert_exactly_once([c[1:] for c in read_coordinates(pipeline.sink.table_uri)
                             + read_coordinates(pipeline.sink.quarantine_uri)], [(p, o) for _, p, o, _, _ in records])

    expected = fold(payloads(records), "none", ("id",), delete_when=lambda value: value["__deleted"] == "true")
    found = table_state(upserted.sink.table_uri, ("id",))
    assert found.keys() == expected.keys() and expected
    assert all({c: found[k][c] for c in row} == row for k, row in expected.items())
    assert quarantined(upserted) == {}

    written = {(p, o): json.loads(v)["payload"] for _, p, o, _, v in records if v is not None}
    tombstones = {(p, o) for _, p, o, _, v in records if v is None}
    for pipeline in (fused, shaped):
        rows_found = query(pipeline.sink.table_uri, "SELECT _kafka_partition, _kafka_offset, id, name, balance, __deleted "
                                                    "FROM {table}")
        assert {(p, o): dict(zip(("id", "name", "balance", "__deleted"), r)) for p, o, *r in rows_found} == written
        assert len(rows_found) == len(written)
        assert {c: e for c, (_, _, e) in quarantined(pipeline).items()} == dict.fromkeys(
            tombstones, "value is null (a tombstone), not a record")
    assert query(unset.sink.table_uri, "SELECT count(*) FROM {table}") == [(0,)]
    reasons = {c: e for c, (_, _, e) in quarantined(unset).items()}
    assert set(reasons) == set(written) | tombstones
    assert {reasons[c] for c in written} == {
        "value is Kafka Connect's JsonConverter wrapper {\"schema\": ..., \"payload\": ...} (the converter's "
        "schemas.enable=true): set format.schemas_enable: true to read its payload"}


# Each connector's source block as it sends it: field types from its SourceInfoStructMaker
# (debezium/debezium: Postgres, Oracle, SqlServer, Binlog (MySQL, MariaDB); yugabyte/
# debezium-connector-yugabytedb: YugabyteDB), values shaped as its documentation's examples
# (documentation/modules/ROOT/pages/connectors/<connector>.adoc, the create event's payload).
def oracle_source(event: ChangeEvent) -> dict:
    # txId is a string ("6.28.807", or hex), scn and commit_scn decimal text, ssn and redo_thread numbers.
    return {"version": "2.7.0.Final", "connector": "oracle", "name": "server1", "ts_ms": 1520085154000, "snapshot": "false",
            "db": "ORCLPDB1", "schema": "DEBEZIUM", "table": "ACCOUNTS", "txId": f"6.{event.lsn % 32}.{event.lsn % 997}",
            "scn": str(event.lsn), "commit_scn": str(event.lsn + 3), "rs_id": "001234.00012345.0124", "ssn": 1,
            "redo_thread": 1, "user_name": "DEBEZIUM"}


def sqlserver_lsn(number: int) -> str:
    # Lsn.toString: the 10 bytes in hex, a colon after the 4th and the 8th.
    digits = f"{number:020x}"
    return f"{digits[:8]}:{digits[8:16]}:{digits[16:]}"


SQLSERVER_BASE = 0xF0000027 << 48  # a virtual log file number beyond what a BIGINT holds once shifted


def sqlserver_source(event: ChangeEvent) -> dict:
    return {"version": "2.7.0.Final", "connector": "sqlserver", "name": "server1", "ts_ms": 1559729468470,
            "snapshot": "false", "db": "testDB", "schema": "dbo", "table": "accounts",
            "change_lsn": sqlserver_lsn(SQLSERVER_BASE + event.lsn * 16 - 2),
            "commit_lsn": sqlserver_lsn(SQLSERVER_BASE + event.lsn * 16), "event_serial_no": 1}


def mysql_source(event: ChangeEvent) -> dict:
    # pos restarts with every binlog file: a new file every 2,000 LSN units here.
    file, pos = divmod(event.lsn, 2000)
    return {"version": "2.7.0.Final", "connector": "mysql", "name": "mysql", "ts_ms": 1651535750218, "snapshot": "false",
            "db": "inventory", "sequence": None, "table": "accounts", "server_id": 223344, "gtid": None,
            "file": f"mysql-bin.{file:06d}", "pos": 4 + pos, "row": 0, "thread": 7, "query": None}


def yugabyte_source(event: ChangeEvent) -> dict:
    # txId and lsn are strings (OpId.toSerString: term:index:key:write_id:time), commit_time a number.
    return {"version": "1.9.5.y.220.4", "connector": "yugabytedb", "name": "dbserver1", "ts_ms": 1680000000000,
            "snapshot": "false", "db": "yugabyte", "schema": "public", "table": "accounts",
            "txId": f"8f7b6a3c-52d1-4c6e-9a7d-{event.lsn:012x}", "lsn": f"1:{event.lsn}::0:{event.lsn * 1000}",
            "commit_time": 1_700_000_000_000_000 + event.lsn, "record_time": 1_700_000_000_000_000 + event.lsn,
            "tablet_id": "ad2ddc0ba0824d6a9c0d0e0f0a0b0c0d", "partition_id": ""}


CONNECTORS = {
    # connector: (its source block, sequence_by (None: offset order), the fold's order of an event)
    "oracle, offset order": (oracle_source, None, None),
    "oracle, by scn": (oracle_source, "source.scn", lambda v: int(v["source"]["scn"])),
    "sqlserver, by commit_lsn": (sqlserver_source, "source.commit_lsn",
                                 lambda v: int(v["source"]["commit_lsn"].replace(":", ""), 16)),
    "mysql, by file and pos": (mysql_source, "CAST(substring_index(source.file, '.', -1) AS DECIMAL(20,0)) * 4294967296 "
                                             "+ source.pos",
                               lambda v: int(v["source"]["file"].split(".")[-1]) * 2**32 + v["source"]["pos"]),
    "yugabytedb, by commit_time": (yugabyte_source, "source.commit_time", lambda v: v["source"]["commit_time"]),
}


@pytest.mark.parametrize("connector", CONNECTORS)
def test_each_connectors_source_block_decodes_and_orders_by_its_own_position(spark, broker, topic, make_pipeline,
                                                                             connector):
    source, sequence_by, order = CONNECTORS[connector]
    # Sequenced: each event to any partition, some late (no tombstones: what one does there is the
    # merge's rule, not the wire's); else each key in its own partition, in order.
    events = [ChangeEvent(e.key, None if e.value is None else {**e.value, "source": source(e)}, e.lsn)
              for e in debezium_events(keys=25, changes=200, seed=21, tombstones=sequence_by is None)]
    produce(broker.bootstrap_servers, topic, events, "shuffled" if sequence_by else "key", seed=5)
    pipeline = debezium(make_pipeline, topic, sequence_by=sequence_by)
    run(pipeline, spark_factory=lambda: spark)

    found = assert_folded(pipeline, broker, topic, sequence=order)
    assert project(found, COLUMNS) == source_state(events)
    assert quarantined(pipeline) == {}
    assert accounted(pipeline) == len(read_back(broker.bootstrap_servers, topic))


# Debezium's decimal.handling.mode=precise, the default: a DECIMAL or NUMERIC(M,D) column is Connect's
# org.apache.kafka.connect.data.Decimal (bytes, parameter "scale"), which JsonConverter writes as
# base64 of the unscaled value's big-endian two's-complement bytes (its decimal.format=BASE64
# default); a NUMERIC without a scale is io.debezium.data.VariableScaleDecimal, a struct {"scale":
# INT32, "value": BYTES} (debezium/debezium documentation/modules/ROOT/pages/connectors/
# postgresql.adoc, "Decimal types"; Kafka's connect/api Decimal and JsonConverter).
DECIMAL_ROW = "id BIGINT, name STRING, balance DECIMAL(10,2), rate DECIMAL(12,4)"
DIGITS_ONLY = -2658824  # its 3 bytes d7 6d f8 in base64 are "1234": a number's text too


def unscaled(number: int) -> str:
    return base64.b64encode(number.to_bytes((number + (number < 0)).bit_length() // 8 + 1, "big", signed=True)).decode()


def with_decimals(events: list[ChangeEvent]) -> list[ChangeEvent]:
    """The events with a balance in cents (base64 of its unscaled value, every seventh change
    DIGITS_ONLY) and a rate of three decimal places (a VariableScaleDecimal), as the connector sends them."""
    def wire(row: dict | None, i: int) -> dict | None:
        if row is None:
            return None
        cents = DIGITS_ONLY if i % 7 == 3 else (row["balance"] - 5000) * 997
        return {**row, "balance": unscaled(cents), "rate": {"scale": 3, "value": unscaled(row["balance"])}}

    return [ChangeEvent(e.key, None if e.value is None else {**e.value, "before": wire(e.value["before"], i),
                                                            "after": wire(e.value["after"], i)}, e.lsn)
            for i, e in enumerate(events)]


def read_decimals(row: dict) -> dict:
    """A row as sent (with_decimals) with its decimals read by the reference: Python's own
    int.from_bytes, written apart from oncemore's decoder."""
    def number(encoded: str, scale: int) -> Decimal:
        return Decimal(int.from_bytes(base64.b64decode(encoded), "big", signed=True)).scaleb(-scale)

    return {**row, "balance": number(row["balance"], 2), "rate": number(row["rate"]["value"], row["rate"]["scale"])}


def assert_decimals_folded(pipeline, records, envelope_kind="debezium", **fold_options):
    """The table equals the fold of ``records`` (read back, unwrapped), key by key, each row's
    decimals read by the reference."""
    expected = fold(records, envelope_kind, ("id",), **fold_options)
    found = table_state(pipeline.sink.table_uri, ("id",))
    assert found.keys() == expected.keys() and expected
    for k, row in expected.items():
        assert {c: found[k][c] for c in row} == read_decimals(row), k


def test_debezium_precise_decimals_land_exactly_with_and_without_jsonconverters_schema(spark, broker, topic,
                                                                                       make_pipeline):
    events = with_decimals(debezium_events(keys=25, changes=200, seed=31))
    # One rate beyond the column's four decimal places: quarantined with its reason, never rounded.
    late = {"id": 1, "name": "ada", "balance": unscaled(100), "rate": {"scale": 6, "value": unscaled(1234567)}}
    events.append(ChangeEvent({"id": 1}, {**events[-1].value, "op": "u", "before": None, "after": late}, events[-1].lsn + 1))
    assert any(e.value and (e.value["after"] or {}).get("balance") == "1234" for e in events)
    produce(broker.bootstrap_servers, topic, events, "key")
    plain = make_pipeline(topic, name="accounts", key={"type": "json", "schema": "id BIGINT"},
                          format={"type": "json", "schema": DECIMAL_ROW}, upsert={"keys": ["id"], "envelope": "debezium"})
    run(plain, spark_factory=lambda: spark)

    records = read_back(broker.bootstrap_servers, topic)
    beyond = [(p, o) for _, p, o, _, v in records if v is not None and b'"scale":6' in v]
    assert len(beyond) == 1
    assert {c: e for c, (_, _, e) in quarantined(plain).items()} == {
        beyond[0]: "column 'after.rate': 1.234567 does not fit DECIMAL(12,4)"}
    assert_decimals_folded(plain, [r for r in records if (r[1], r[2]) not in beyond])
    assert accounted(plain) == len(records)
    balances = query(plain.sink.table_uri, "SELECT balance FROM {table}")
    assert (Decimal("-26588.24"),) in balances and (Decimal("1234.00"),) not in balances


def test_through_jsonconverter_a_decimal_is_read_at_the_scale_its_schema_gives_under_either_envelope(
        spark, broker, topic, make_pipeline):
    # The source's balance is NUMERIC(10,2), its schema Decimal with scale "2"; the table declares
    # DECIMAL(12,4): read at the schema's scale, 12.34 is 12.3400 (at the declared one it would be 0.1234).
    balance = connect_field("balance", "bytes", name="org.apache.kafka.connect.data.Decimal", version=1,
                            parameters={"scale": "2", "connect.decimal.precision": "10"})
    rate = {"type": "struct", "fields": [connect_field("scale", "int32", False), connect_field("value", "bytes", False)],
            "optional": True, "name": "io.debezium.data.VariableScaleDecimal", "version": 1,
            "doc": "Variable scaled decimal", "field": "rate"}
    value = {**VALUE_SCHEMA, "fields": [*ROW_FIELDS[:2], balance, rate]}
    envelope_schema = {**ENVELOPE_SCHEMA, "fields": [{**value, "field": "before"}, {**value, "field": "after"},
                                                     *ENVELOPE_SCHEMA["fields"][2:]]}
    flat = {**value, "fields": [*value["fields"], connect_field("__deleted", "string")]}
    events = with_decimals(debezium_events(keys=25, changes=150, seed=32))
    wrapped = [ChangeEvent(connect_wrapped(KEY_SCHEMA, e.key),
                           None if e.value is None else connect_wrapped(envelope_schema, e.value), e.lsn) for e in events]
    produce(broker.bootstrap_servers, topic, wrapped, "key")
    flattened = f"{topic}_flat"  # the same changes after ExtractNewRecordState (see the test above)
    broker.create_topic(flattened, 3)
    produce(broker.bootstrap_servers, flattened, [ChangeEvent(
        connect_wrapped(KEY_SCHEMA, e.key), None if e.value is None else connect_wrapped(flat, {
            **(e.value["before"] if e.value["op"] == "d" else e.value["after"]),
            "__deleted": "true" if e.value["op"] == "d" else "false"}), e.lsn) for e in events], "key")
    wire = dict(key={"type": "json", "schema": "id BIGINT", "schemas_enable": True})
    row = "id BIGINT, name STRING, balance DECIMAL(12,4), rate DECIMAL(12,4)"
    enveloped = make_pipeline(topic, name="accounts", **wire, format={"type": "json", "schema": row, "schemas_enable": True},
                              upsert={"keys": ["id"], "envelope": "debezium"})
    plain_rows = make_pipeline(flattened, name="flat_accounts", **wire,
                               format={"type": "json", "schema": row + ", __deleted STRING", "schemas_enable": True},
                               upsert={"keys": ["id"], "delete_when": "__deleted = 'true'"})
    for pipeline, source in ((enveloped, topic), (plain_rows, flattened)):
        run(pipeline, spark_factory=lambda: spark)
        records = payloads(read_back(broker.bootstrap_servers, source))
        options = {} if pipeline is enveloped else {"delete_when": lambda v: v["__deleted"] == "true"}
        assert_decimals_folded(pipeline, records, "debezium" if pipeline is enveloped else "none", **options)
        assert quarantined(pipeline) == {}
        assert accounted(pipeline) == len(records)
        # Cents, as the source holds them: none read at the declared scale (0.1234 for 12.34).
        balances = [b for (b,) in query(pipeline.sink.table_uri, "SELECT balance FROM {table}")]
        assert balances and all(b == b.quantize(Decimal("0.01")) for b in balances)
