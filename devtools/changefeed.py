"""Change feeds for the upsert tests and the demo: a simulated Debezium source table
``accounts(id BIGINT, name STRING, balance BIGINT)`` and its final state, its change events produced
to Kafka and read back, the reference fold of those records into the rows an upsert ingestion must
end with, and a Delta table's rows to compare them with. Written apart from oncemore's own upsert
code: it is what that code is checked against.

Every state is ``{key tuple: row dict}``; a fold's rows also carry ``_kafka_topic``,
``_kafka_partition`` and ``_kafka_offset`` of the record that made them (``project`` keeps chosen
columns only).
"""

from __future__ import annotations

import json
import logging
import random
import time
import zlib
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Iterable, Literal

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

Record = tuple[str, int, int, bytes | None, bytes | None]  # (topic, partition, offset, key, value) as read back
State = dict[tuple, dict[str, Any]]
NAMES = ("ada", "grace", "edsger", "barbara", "donald", "frances", "ken", "radia")
SOURCE = {"connector": "postgresql", "name": "demo", "db": "shop", "schema": "public", "table": "accounts"}


@dataclass(frozen=True)
class ChangeEvent:
    key: dict[str, Any]
    value: dict[str, Any] | None  # Debezium's envelope; None for a tombstone
    lsn: int


def debezium_events(keys: int, changes: int, seed: int, *, snapshot_share: float = 0.75,
                    delete_share: float = 0.2, tombstones: bool = True) -> list[ChangeEvent]:
    """A snapshot (op r) of about ``snapshot_share`` of ids 1..``keys``, then ``changes`` random
    changes: c for an absent id (re-creates of deleted ones too), else d (``delete_share``) or u.
    LSNs strictly increase; with ``tombstones`` each d is followed by its key's tombstone."""
    rng = random.Random(seed)
    state: dict[int, dict[str, Any]] = {}
    events: list[ChangeEvent] = []
    lsn, tx_id = 24_000_000, 700

    def emit(op: str, before: dict | None, after: dict | None, snapshot: str) -> None:
        nonlocal lsn, tx_id
        lsn, tx_id = lsn + rng.randint(8, 96), tx_id + 1
        ts_ms = 1_790_000_000_000 + lsn // 8
        row = after or before
        source = {**SOURCE, "lsn": lsn, "txId": tx_id, "ts_ms": ts_ms, "snapshot": snapshot}
        events.append(ChangeEvent({"id": row["id"]}, {"before": before, "after": after, "op": op,
                                                      "ts_ms": ts_ms + 5, "source": source, "transaction": None}, lsn))
        if op == "d" and tombstones:
            events.append(ChangeEvent({"id": row["id"]}, None, lsn))

    def new_row(id_: int) -> dict[str, Any]:
        return {"id": id_, "name": rng.choice(NAMES), "balance": rng.randint(0, 10_000)}

    initial = [id_ for id_ in range(1, keys + 1) if rng.random() < snapshot_share]
    for i, id_ in enumerate(initial):
        state[id_] = new_row(id_)
        emit("r", None, state[id_], "last" if i == len(initial) - 1 else "true")
    for _ in range(changes):
        id_ = rng.randint(1, keys)
        if id_ not in state:
            state[id_] = new_row(id_)
            emit("c", None, state[id_], "false")
        elif rng.random() < delete_share:
            emit("d", state.pop(id_), None, "false")
        else:
            before, state[id_] = state[id_], {**new_row(id_), "name": state[id_]["name"]}
            emit("u", before, state[id_], "false")
    return events


def source_state(events: Iterable[ChangeEvent]) -> State:
    """The source table after ``events``, in their (source) order: ``{(id,): row}``."""
    state: State = {}
    for event in events:
        if event.value is None:
            continue
        if event.value["op"] == "d":
            state.pop((event.key["id"],), None)
        else:
            state[(event.key["id"],)] = dict(event.value["after"])
    return state


def _client(bootstrap: str) -> dict[str, Any]:
    # Through Python logging, as devtools.kafkabroker's clients: a retry's warning is not printed.
    return {"bootstrap.servers": bootstrap, "logger": logging.getLogger("devtools.changefeed")}


def _encode(document: dict | None) -> bytes | None:
    return None if document is None else json.dumps(document, separators=(",", ":")).encode()


def produce(bootstrap: str, topic: str, events: Iterable[ChangeEvent],
            partitions_by: Literal["key", "shuffled"] = "key", *, partitions: int | None = None,
            lateness: int = 8, seed: int = 0, config: dict[str, Any] | None = None) -> int:
    """Writes ``events`` to ``topic`` (created by the caller, of ``partitions`` partitions, else
    as its metadata says) as Debezium's JSON converter would (schemas disabled), a tombstone's value
    null. "key": each event to crc32(key) mod partitions, in order. "shuffled": each event to a
    random partition, each delayed by up to ``lateness`` places. Returns the count delivered."""
    producer = Producer({**_client(bootstrap), "enable.idempotence": True, "linger.ms": 20, **(config or {})})
    if partitions is None:
        metadata = producer.list_topics(topic, timeout=30).topics[topic]
        if metadata.error is not None:
            raise RuntimeError(f"topic {topic}: {metadata.error}")
        partitions = len(metadata.partitions)
    records = [(_encode(e.key), _encode(e.value)) for e in events]
    rng = random.Random(seed)
    if partitions_by == "key":
        placed = [(zlib.crc32(key) % partitions, key, value) for key, value in records]
    elif partitions_by == "shuffled":
        delayed = sorted(range(len(records)), key=lambda i: i + rng.uniform(0, lateness))
        placed = [(rng.randrange(partitions), *records[i]) for i in delayed]
    else:
        raise ValueError(f"partitions_by is 'key' or 'shuffled', not {partitions_by!r}")
    failures: list[str] = []
    delivered = 0

    def on_delivery(error, _message) -> None:
        nonlocal delivered
        if error is not None:
            failures.append(str(error))
        else:
            delivered += 1

    for partition, key, value in placed:
        while True:
            try:
                producer.produce(topic, value=value, key=key, partition=partition, on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush(60)
    if failures or delivered != len(placed):
        raise RuntimeError(f"{topic}: {delivered} of {len(placed)} records delivered; failures: {failures[:3]}")
    return delivered


def read_back(bootstrap: str, topic: str, *, seconds: float = 60, config: dict[str, Any] | None = None) -> list[Record]:
    """Every record of ``topic``, log start to the high watermark of when it is called, as
    (topic, partition, offset, key, value) in (partition, offset) order: assigned, never committed."""
    consumer = Consumer({**_client(bootstrap), "group.id": "devtools.changefeed", "enable.auto.commit": False,
                         "enable.partition.eof": True, **(config or {})})
    try:
        ends, starts = {}, []
        for partition in consumer.list_topics(topic, timeout=30).topics[topic].partitions:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=30)
            if high > low:
                ends[partition] = high
                starts.append(TopicPartition(topic, partition, low))
        consumer.assign(starts)
        records: list[Record] = []
        pending, deadline = set(ends), time.monotonic() + seconds
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(pending)} not read to their end in {seconds:.0f}s")
            for message in consumer.consume(1000, timeout=0.5):
                partition, offset = message.partition(), message.offset()
                if message.error() is not None:
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"{topic}-{partition}: {message.error()}")
                elif offset < ends[partition]:
                    records.append((topic, partition, offset, message.key(), message.value()))
                if offset >= ends[partition] - (message.error() is None):
                    pending.discard(partition)
        return sorted(records, key=lambda r: r[:3])
    finally:
        consumer.close()


def fold(records: Iterable[Record], envelope: Literal["debezium", "none"] = "debezium",
         key_columns: tuple[str, ...] = ("id",), sequence: Callable[[dict], Any] | None = None,
         delete_when: Callable[[dict], bool] | None = None) -> State:
    """The rows an upsert ingestion of ``records`` ends with. Without ``sequence``, each record in
    (partition, offset) order upserts or deletes its key, a null value deleting (raises when a key
    is in two partitions). With it, a key's record of the greatest (sequence, topic, partition,
    offset) decides, deletes included; a null value carries no sequence and deletes its key when
    that record came from the null value's partition at a lower offset (one partition's order is
    Kafka's, whatever the sequences say)."""
    def key_of(document: dict | None, kafka_key: bytes | None) -> tuple:
        if document is None and kafka_key is None:
            raise ValueError("a delete without a key: no before image and no Kafka key")
        return tuple((document if document is not None else json.loads(kafka_key))[c] for c in key_columns)

    latest: dict[tuple, tuple[tuple, dict | None]] = {}  # key -> (order, row or None for a delete)
    nulls: dict[tuple, list[tuple[str, int, int]]] = {}  # under a sequence: key -> its null values' coordinates
    for topic, partition, offset, kafka_key, raw in sorted(records, key=lambda r: r[:3]):
        value = None if raw is None else json.loads(raw)
        if value is None:
            if sequence is not None:
                nulls.setdefault(key_of(None, kafka_key), []).append((topic, partition, offset))
                continue
            key, row = key_of(None, kafka_key), None
        elif envelope == "debezium":
            if value["op"] not in ("c", "r", "u", "d"):
                raise ValueError(f"{topic}-{partition}@{offset}: Debezium op {value['op']!r} is not folded")
            row = value["after"] if value["op"] != "d" else None
            key = key_of(row if row is not None else value["before"], kafka_key)
        elif envelope == "none":
            row = None if delete_when is not None and delete_when(value) else value
            key = key_of(value, kafka_key)
        else:
            raise ValueError(f"envelope is 'debezium' or 'none', not {envelope!r}")
        if sequence is None:
            if key in latest and latest[key][0][:2] != (topic, partition):
                raise ValueError(f"key {key} is in {latest[key][0][0]}-{latest[key][0][1]} and {topic}-{partition}: "
                                 "offset order needs each key in one partition (fold with a sequence)")
            order: tuple = (topic, partition, offset)
        else:
            number = sequence(value)
            if number is None:
                raise ValueError(f"{topic}-{partition}@{offset}: no sequence for key {key}")
            order = (Decimal(str(number)), topic, partition, offset)
        if key not in latest or order > latest[key][0]:
            latest[key] = (order, row)
    for key, coordinates in nulls.items():
        if key in latest and latest[key][1] is not None and any(
                (t, p) == latest[key][0][-3:-1] and o > latest[key][0][-1] for t, p, o in coordinates):
            latest[key] = (latest[key][0], None)
    return {key: {**row, "_kafka_topic": order[-3], "_kafka_partition": order[-2], "_kafka_offset": order[-1]}
            for key, (order, row) in latest.items() if row is not None}


def table_state(table_uri: str, key_columns: tuple[str, ...] = ("id",),
                storage_options: dict[str, str] | None = None) -> State:
    """The rows of the Delta table at ``table_uri`` by key; raises if a key is on two rows."""
    from deltalake import DeltaTable

    state: State = {}
    for row in DeltaTable(table_uri, storage_options=storage_options).to_pyarrow_table().to_pylist():
        key = tuple(row[c] for c in key_columns)
        if key in state:
            raise ValueError(f"{table_uri}: key {key} is on two rows")
        state[key] = row
    return state


def project(state: State, columns: Iterable[str]) -> State:
    """``state`` with only ``columns`` in each row (to compare a fold, a table and a source)."""
    columns = tuple(columns)
    return {key: {c: row[c] for c in columns} for key, row in state.items()}
