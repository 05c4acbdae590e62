"""Change streams as Debezium's connectors send them, ingested end to end on the real broker and
counted: every record of the committed ranges in the table or the quarantine table exactly once,
and the table equal to the fold of the events key by key (test_upsert.py's helpers). The events are
written as the connectors write them: the field types of each connector's ``source`` block, Kafka
Connect's JsonConverter wrapper, Debezium's precise decimals; each test cites its reference."""

from __future__ import annotations

import json

from conftest import query
from devtools.changefeed import read_back
from test_upsert import accounted, assert_folded, debezium, envelope, key
from oncemore.run.runner import run


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
