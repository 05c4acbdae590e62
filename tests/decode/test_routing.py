"""Routing a batch of records by ``routes.by`` (decode/routing.py), before any decoding: every
record routed, unrouted with its reason, or malformed with its reason."""

from __future__ import annotations

import json

import pyarrow as pa

from oncemore.decode.routing import UNROUTED, Router, RouterSpec

HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))


def batch(values=None, keys=None, headers=None) -> pa.RecordBatch:
    count = len(next(c for c in (values, keys, headers) if c is not None))
    return pa.record_batch({
        "key": pa.array(keys or [None] * count, pa.binary()),
        "value": pa.array(values or [None] * count, pa.binary()),
        "headers": pa.array(headers or [[]] * count, HEADERS)})


def test_a_json_values_field_routes_each_record_and_names_why_the_others_are_not():
    values = [json.dumps({"type": "paid"}).encode(), json.dumps({"type": "created", "id": 1}).encode(),
              json.dumps({"type": "refunded"}).encode(), json.dumps({"id": 2}).encode(), b"{not json",
              json.dumps({"type": 7}).encode(), None]
    routed = Router(RouterSpec("value", ("type",), None, ("created", "paid"))).route(batch(values))

    assert routed.index.tolist() == [1, 0, UNROUTED, UNROUTED, UNROUTED, UNROUTED, UNROUTED]
    assert routed.unrouted[2] == "routes.by value.type is 'refunded', which names no route (created, paid)"
    assert routed.unrouted[3] == routed.unrouted[6] == "routes.by value.type is missing or null: no route"
    assert set(routed.malformed) == {4, 5} and all(r.startswith("routes.by value.type: ") for r in routed.malformed.values())
    assert not set(routed.malformed) & set(routed.unrouted)


def test_a_nested_field_of_a_jsonconverter_payload_routes_as_the_field_of_the_record():
    wrapped = [json.dumps({"schema": {"type": "struct"}, "payload": {"meta": {"kind": kind}}}).encode()
               for kind in ("b", "a", "c")]
    routed = Router(RouterSpec("value", ("meta", "kind"), None, ("a", "b"), wrapped=True)).route(batch(wrapped))

    assert routed.index.tolist() == [1, 0, UNROUTED]
    assert routed.unrouted == {2: "routes.by value.meta.kind is 'c', which names no route (a, b)"}


def test_a_header_routes_by_its_last_value_and_a_key_as_utf8_text():
    headers = [[{"key": "event_type", "value": b"created"}, {"key": "event_type", "value": b"paid"}],
               [{"key": "other", "value": b"paid"}], [{"key": "event_type", "value": b"created"}]]
    by_header = Router(RouterSpec("header", (), "event_type", ("created", "paid"))).route(batch(headers=headers))
    assert by_header.index.tolist() == [1, UNROUTED, 0]
    assert by_header.unrouted == {1: "routes.by headers['event_type'] is missing or null: no route"}

    by_key = Router(RouterSpec("key", (), None, ("created", "paid"))).route(batch(keys=[b"paid", b"\xff", None]))
    assert by_key.index.tolist() == [1, UNROUTED, UNROUTED]
    assert by_key.malformed == {1: "routes.by: the key is not valid UTF-8 (byte 0)"}
    assert by_key.unrouted == {2: "routes.by key is missing or null: no route"}
