"""Protobuf in Confluent's wire format: messages built from descriptors at run time (no generated code),
produced by confluent-kafka's own ProtobufSerializer against Apicurio Registry (a JVM of its own,
reached over HTTP), decoded by ProtobufDecoder in a spawned process, written to Delta and
read back by DuckDB."""

from __future__ import annotations

import datetime
from dataclasses import replace
from decimal import Decimal

import pyarrow as pa
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from deltalake import DeltaTable, write_deltalake
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2, wrappers_pb2
from google.protobuf.descriptor_pb2 import FieldDescriptorProto as Field
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from conftest import decode_in_child, duckdb_connection
from oncemore.core.columns import SchemaError
from oncemore.decode.protobuf.decoder import ProtobufDecoder, protobuf_to_arrow
from oncemore.decode.registry import Registry, RegistryError

UTC = datetime.timezone.utc
OPTIONAL, REPEATED = Field.LABEL_OPTIONAL, Field.LABEL_REPEATED


def money_file() -> descriptor_pb2.FileDescriptorProto:
    """An imported file of the user's own: the serializer registers it under a subject of its own."""
    proto = descriptor_pb2.FileDescriptorProto(name="shop/money.proto", package="shop.common", syntax="proto3")
    money = proto.message_type.add(name="Money")
    money.field.add(name="currency", number=1, type=Field.TYPE_STRING, label=OPTIONAL)
    money.field.add(name="units", number=2, type=Field.TYPE_INT64, label=OPTIONAL)
    return proto


def order_file(version: int = 1) -> descriptor_pb2.FileDescriptorProto:
    """shop/order.proto; version 2 adds Order.channel (20) and Order.Item.color (4); version 3
    is version 1 with Order.id a string."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="shop/order.proto", package="shop", syntax="proto3",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto", "shop/money.proto"])
    status = proto.enum_type.add(name="Status")
    for number, name in enumerate(["NEW", "PAID", "SHIPPED"]):
        status.value.add(name=name, number=number)
    order = proto.message_type.add(name="Order")
    item = order.nested_type.add(name="Item")
    item.field.add(name="sku", number=1, type=Field.TYPE_STRING, label=OPTIONAL)
    item.field.add(name="qty", number=2, type=Field.TYPE_UINT32, label=OPTIONAL)
    item.field.add(name="tags", number=3, type=Field.TYPE_STRING, label=REPEATED)
    if version == 2:
        item.field.add(name="color", number=4, type=Field.TYPE_STRING, label=OPTIONAL)
    counts = order.nested_type.add(name="CountsEntry")
    counts.options.map_entry = True
    counts.field.add(name="key", number=1, type=Field.TYPE_STRING, label=OPTIONAL)
    counts.field.add(name="value", number=2, type=Field.TYPE_INT64, label=OPTIONAL)
    lines = order.nested_type.add(name="ByLineEntry")
    lines.options.map_entry = True
    lines.field.add(name="key", number=1, type=Field.TYPE_INT32, label=OPTIONAL)
    lines.field.add(name="value", number=2, type=Field.TYPE_MESSAGE, type_name=".shop.Order.Item", label=OPTIONAL)
    order.nested_type.add(name="Nothing")  # a message without fields: no column, as in Spark
    add = order.field.add
    add(name="id", number=1, type=Field.TYPE_STRING if version >= 3 else Field.TYPE_INT64, label=OPTIONAL)
    add(name="status", number=2, type=Field.TYPE_ENUM, type_name=".shop.Status", label=OPTIONAL)
    add(name="placed", number=3, type=Field.TYPE_MESSAGE, type_name=".google.protobuf.Timestamp", label=OPTIONAL)
    add(name="items", number=4, type=Field.TYPE_MESSAGE, type_name=".shop.Order.Item", label=REPEATED)
    add(name="counts", number=5, type=Field.TYPE_MESSAGE, type_name=".shop.Order.CountsEntry", label=REPEATED)
    add(name="by_line", number=6, type=Field.TYPE_MESSAGE, type_name=".shop.Order.ByLineEntry", label=REPEATED)
    add(name="note", number=7, type=Field.TYPE_MESSAGE, type_name=".google.protobuf.StringValue", label=OPTIONAL)
    add(name="discount", number=8, type=Field.TYPE_MESSAGE, type_name=".google.protobuf.Int64Value", label=OPTIONAL)
    add(name="total", number=9, type=Field.TYPE_MESSAGE, type_name=".shop.common.Money", label=OPTIONAL)
    add(name="big", number=10, type=Field.TYPE_UINT64, label=OPTIONAL)
    add(name="digest", number=11, type=Field.TYPE_BYTES, label=OPTIONAL)
    add(name="ratio", number=12, type=Field.TYPE_DOUBLE, label=OPTIONAL)
    add(name="gift", number=13, type=Field.TYPE_BOOL, label=OPTIONAL)
    add(name="priority", number=14, type=Field.TYPE_INT32, label=OPTIONAL, proto3_optional=True, oneof_index=1)
    add(name="email", number=15, type=Field.TYPE_STRING, label=OPTIONAL, oneof_index=0)
    add(name="phone", number=16, type=Field.TYPE_STRING, label=OPTIONAL, oneof_index=0)
    add(name="weight", number=17, type=Field.TYPE_FLOAT, label=OPTIONAL)
    add(name="delta", number=18, type=Field.TYPE_SINT64, label=OPTIONAL)
    add(name="code", number=19, type=Field.TYPE_FIXED32, label=OPTIONAL)
    add(name="nothing", number=21, type=Field.TYPE_MESSAGE, type_name=".shop.Order.Nothing", label=OPTIONAL)
    if version == 2:
        add(name="channel", number=20, type=Field.TYPE_STRING, label=OPTIONAL)
    order.oneof_decl.add(name="contact")
    order.oneof_decl.add(name="_priority")  # proto3 `optional` is a synthetic oneof (they come last)
    other = proto.message_type.add(name="Other")
    other.field.add(name="x", number=1, type=Field.TYPE_INT32, label=OPTIONAL)
    return proto


def message_classes(version: int = 1) -> dict:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(wrappers_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(money_file())
    pool.Add(order_file(version))
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(name))
            for name in ("shop.Order", "shop.Order.Item", "shop.Other", "shop.common.Money")}


def order(classes: dict, i: int):
    Order, Item, Money = classes["shop.Order"], classes["shop.Order.Item"], classes["shop.common.Money"]
    message = Order(id=i + 1, status=i % 3, items=[Item(sku=f"sku-{k}", qty=k + 1, tags=["t"] * k) for k in range(i % 3)],
                    counts={"seen": i + 1}, big=2 ** 64 - 1 - i, digest=bytes([i]), ratio=i / 4, gift=bool(i % 2),
                    weight=0.25, delta=-i - 1, code=4_000_000_000, total=Money(currency="EUR", units=100 + i))
    message.by_line[i].sku = f"line-{i}"
    message.placed.FromNanoseconds(1_700_000_000_123_456_789 + i * 1000)
    if i % 2:
        message.note.value, message.discount.value, message.email = f"note {i}", 0, f"u{i}@x"
    else:
        message.phone = f"+{i}"
    return message


def expected_row(i: int) -> dict:
    return {
        "id": i + 1, "status": ["NEW", "PAID", "SHIPPED"][i % 3] if i % 3 else None,  # NEW is the default: NULL
        "placed": datetime.datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=UTC) + datetime.timedelta(microseconds=i),
        "items": [{"sku": f"sku-{k}", "qty": k + 1, "tags": ["t"] * k} for k in range(i % 3)],
        "counts": [("seen", i + 1)], "by_line": [(i, {"sku": f"line-{i}", "qty": None, "tags": []})],
        "note": f"note {i}" if i % 2 else None, "discount": 0 if i % 2 else None,
        "total": {"currency": "EUR", "units": 100 + i}, "big": Decimal(2 ** 64 - 1 - i), "digest": bytes([i]),
        "ratio": i / 4 if i else None, "gift": True if i % 2 else None, "priority": None,
        "email": f"u{i}@x" if i % 2 else None, "phone": None if i % 2 else f"+{i}",
        "weight": 0.25, "delta": -i - 1, "code": 4_000_000_000,
    }


@pytest.fixture
def elsewhere(spawned):
    """Decodes in another Python process (spawned: nothing inherited), as a Spark worker does."""
    return lambda settings, reader, values: spawned(decode_in_child, settings, "protobuf", reader, values)


def produce(registry, topic: str, messages: list) -> list[bytes | None]:
    client = SchemaRegistryClient(registry.settings())
    serializers = {}
    context = SerializationContext(topic, MessageField.VALUE)
    values = []
    for message in messages:
        if message is None:
            values.append(None)
            continue
        kind = type(message)
        serializers.setdefault(kind, ProtobufSerializer(kind, client))
        values.append(serializers[kind](message, context))
    return values


def assert_delta_round_trip(table: pa.Table, path: str) -> None:
    write_deltalake(path, table)
    assert DeltaTable(path).to_pyarrow_table().sort_by("id").to_pylist() == table.sort_by("id").to_pylist()
    read = duckdb_connection().execute(f"SELECT * FROM delta_scan('{path}') ORDER BY id").to_arrow_table()
    assert read.to_pylist() == table.sort_by("id").to_pylist()


def test_nested_repeated_map_timestamp_and_enum_round_trip_through_delta(registry, elsewhere, tmp_path):
    classes = message_classes()
    values = produce(registry, "orders", [order(classes, i) for i in range(6)] + [None])
    kind, table, errors = elsewhere(registry.settings(), ("orders-value", "latest"), values)
    assert kind == "decoded" and errors == {}
    assert table.num_rows == 7 and set(table.slice(6).to_pylist()[0].values()) == {None}  # tombstone
    assert table.slice(0, 6).to_pylist() == [expected_row(i) for i in range(6)]
    assert_delta_round_trip(table.slice(0, 6), str(tmp_path / "orders"))
    # The serializer registered the imported file under a subject of its own and referenced it.
    client = SchemaRegistryClient(registry.settings())
    assert "shop/money.proto" in client.get_subjects()
    references = client.get_latest_version("orders-value").schema.references
    assert [(r.name, r.subject, r.version) for r in references] == [("shop/money.proto", "shop/money.proto", 1)]


def test_fields_without_presence_read_their_default_as_null_as_spark_does(registry, elsewhere):
    classes = message_classes()
    Order = classes["shop.Order"]
    explicit_zeros = Order(id=0, status=0, priority=0, email="", ratio=0.0)
    values = produce(registry, "orders", [explicit_zeros, Order()])
    kind, table, errors = elsewhere(registry.settings(), ("orders-value", "latest"), values)
    rows = table.to_pylist()
    assert (kind, errors) == ("decoded", {})
    # No presence (proto3 singular): the default is not on the wire, so NULL. Presence (optional,
    # oneof, messages): set means set, even to zero. Repeated fields and maps: empty, never NULL.
    assert [rows[0][c] for c in ("id", "status", "ratio", "priority", "email", "placed", "items", "counts")] == [
        None, None, None, 0, "", None, [], []]
    assert [rows[1][c] for c in ("id", "priority", "email", "items", "counts", "by_line")] == [None, None, None, [], [], []]


def test_table_schema_follows_spark_and_delta():
    schema = protobuf_to_arrow(message_classes()["shop.Order"].DESCRIPTOR)
    item = pa.struct([("sku", pa.string()), ("qty", pa.int64()), ("tags", pa.list_(pa.field("element", pa.string())))])
    assert schema == pa.schema([
        ("id", pa.int64()), ("status", pa.string()), ("placed", pa.timestamp("us", "UTC")),
        ("items", pa.list_(pa.field("element", item))),
        ("counts", pa.map_(pa.field("key", pa.string(), nullable=False), pa.field("value", pa.int64()))),
        ("by_line", pa.map_(pa.field("key", pa.int32(), nullable=False), pa.field("value", item))),
        ("note", pa.string()), ("discount", pa.int64()),
        ("total", pa.struct([("currency", pa.string()), ("units", pa.int64())])),
        ("big", pa.decimal128(20, 0)), ("digest", pa.binary()), ("ratio", pa.float64()), ("gift", pa.bool_()),
        ("priority", pa.int32()), ("email", pa.string()), ("phone", pa.string()), ("weight", pa.float32()),
        ("delta", pa.int64()), ("code", pa.int64())])  # `nothing` (a message without fields) has no column
    assert to_arrow_schema(from_arrow_schema(schema), timezone="UTC") == schema
    from deltalake import Schema as DeltaSchema
    DeltaSchema.from_arrow(schema)


def test_recursive_messages_are_refused_naming_the_field():
    proto = descriptor_pb2.FileDescriptorProto(name="tree.proto", package="t", syntax="proto3")
    node = proto.message_type.add(name="Node")
    node.field.add(name="children", number=1, type=Field.TYPE_MESSAGE, type_name=".t.Node", label=REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    with pytest.raises(SchemaError, match="children: message t.Node contains itself"):
        protobuf_to_arrow(pool.FindMessageTypeByName("t.Node"))


def test_a_newer_schema_adding_fields_reads_older_records_as_null_and_is_ahead_of_the_old_table(
        registry, elsewhere, tmp_path):
    v1, v2 = message_classes(1), message_classes(2)
    old = [v1["shop.Order"](id=i, items=[v1["shop.Order.Item"](sku="a")]) for i in (1, 2)]
    new = [v2["shop.Order"](id=3, channel="web", items=[v2["shop.Order.Item"](sku="b", color="red")])]
    values = produce(registry, "evolving", old[:1] + new + old[1:])

    kind, table, errors = elsewhere(registry.settings(), ("evolving-value", "latest"), values)
    assert kind == "decoded" and errors == {}
    assert table.schema == protobuf_to_arrow(v2["shop.Order"].DESCRIPTOR)
    assert [(r["id"], r["channel"], r["items"][0]["color"]) for r in table.to_pylist()] == [
        (1, None, None), (3, "web", "red"), (2, None, None)]
    assert_delta_round_trip(table, str(tmp_path / "evolving"))

    result = elsewhere(registry.settings(), ("evolving-value", 1), values)
    assert result[:3] == ("ahead", 1, int.from_bytes(values[1][1:5], "big"))
    assert "field items.color (number 4)" in result[3] and "field channel (number 20)" in result[3]


def test_records_that_cannot_be_decoded_are_errors_with_reasons(registry, elsewhere):
    classes = message_classes()
    Order, Other = classes["shop.Order"], classes["shop.Other"]
    good, other = produce(registry, "broken", [order(classes, 1), Other(x=1)])
    header = good[:5]
    renamed = produce(registry, "broken", [message_classes(3)["shop.Order"](id="text")])[0]  # id became a string
    unknown_enum = produce(registry, "broken", [Order(id=9, status=7)])[0]  # proto3 enums are open
    values = [
        good, b"\x00\x00\x00\x7f\xff" + good[5:], b"{\"id\": 1}", b"\x00\x00", good[:-7], header + b"\x00\xff\xff\xff\xff",
        other, header + b"\x02\x0a" + good[6:], header + b"\x00" + Order(id=1).SerializeToString() + b"\xa0\x06\x01",
        renamed, unknown_enum, header + b"\x06\x00",
    ]
    kind, table, errors = elsewhere(registry.settings(), ("broken-value", 1), values)
    assert kind == "decoded"
    assert table.column("id").to_pylist() == [2] + [None] * 11
    assert sorted(errors) == list(range(1, 12))
    assert "schema ID 32767 is not in the registry" in errors[1]
    assert "not Confluent's magic byte 0" in errors[2]
    assert "too short for Confluent framing" in errors[3]
    assert "payload is not a shop.Order message" in errors[4] and "truncated or garbage" in errors[4]
    assert "payload is not a shop.Order message" in errors[5]
    assert "wrote a shop.Other message; the table holds shop.Order" in errors[6]
    assert "message indexes [5] point at no message" in errors[7]
    assert "the payload has field numbers [100]" in errors[8]
    assert "id is string in the writer, int64 in the table" in errors[9]
    assert "field status: 7 is not a value of enum shop.Status" in errors[10]
    assert "message indexes after schema ID" in errors[11] and "ends inside them" in errors[11]


def test_decoders_pickle_for_spark_workers(registry):
    import pickle

    produce(registry, "pickled-proto", [message_classes()["shop.Order"](id=1)])
    registry_client = Registry(registry.settings())
    decoder = ProtobufDecoder(registry_client, registry_client.latest("pickled-proto-value", fmt="serialized").schema)
    copy = pickle.loads(pickle.dumps(decoder))
    assert copy.schema == decoder.schema == protobuf_to_arrow(message_classes()["shop.Order"].DESCRIPTOR)


def test_records_of_the_readers_own_id_are_read_without_asking_the_registry(registry):
    values = produce(registry, "own-id-proto", [message_classes()["shop.Order"](id=5)])
    live = Registry(registry.settings())
    reader = live.latest("own-id-proto-value", fmt="serialized").schema
    dead = Registry({"url": "http://127.0.0.1:9", "max.retries": 0})
    decoder, anonymous = ProtobufDecoder(live, reader), ProtobufDecoder(live, replace(reader, id=None))
    decoder.registry = anonymous.registry = dead  # down once the readers (and their imports) are built
    assert decoder.decode(pa.array(values, pa.binary())).table.column("id").to_pylist() == [5]
    with pytest.raises(RegistryError, match=rf"schema ID {reader.id}: ConnectError"):
        anonymous.decode(pa.array(values, pa.binary()))


def test_a_writer_the_run_refused_makes_errors_of_its_records_instead_of_stopping_the_range(registry):
    import pickle

    v1, v2 = message_classes(1), message_classes(2)
    values = produce(registry, "refusing", [v1["shop.Order"](id=1), v2["shop.Order"](id=2, channel="web")])
    registry_client = Registry(registry.settings())
    first = registry_client.version("refusing-value", 1, fmt="serialized").schema
    newer_id = int.from_bytes(values[1][1:5], "big")

    decoder = pickle.loads(pickle.dumps(ProtobufDecoder(registry_client, first, refused={newer_id: "no room"})))
    decoded = decoder.decode(pa.array(values, pa.binary()))

    assert decoder.message_name == "shop.Order"
    assert decoded.errors == {1: "no room"} and decoded.table.column("id").to_pylist() == [1, None]
