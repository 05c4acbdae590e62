"""commit/merge.py on delta-rs alone (no Kafka, no Spark): change rows applied to a table the way a
part's commit applies them, for the cases a run rarely produces on demand: keys whose file
statistics delta-rs truncates, and a tombstones table whose positions a rewinding reset left ahead."""

from __future__ import annotations

import pyarrow as pa
from deltalake import DeltaTable

from oncemore.commit.merge import UpsertSpec, apply, reduce_changes
from oncemore.core.columns import CHANGE_COLUMN, METADATA_FIELDS, SEQUENCE_FIELD, tombstones_schema
from oncemore.core.coordinates import KafkaPartition
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger

PARTITION = KafkaPartition("t", 0)


class Tables:
    def __init__(self, root, key: pa.Field):
        self.main, self.tombstones = str(root / "main"), str(root / "tombstones")
        self.schema = pa.schema([key, pa.field("v", pa.string()), SEQUENCE_FIELD] + METADATA_FIELDS)
        DeltaTable.create(self.main, self.schema)
        DeltaTable.create(self.tombstones, tombstones_schema(pa.schema([key])))
        self.spec = UpsertSpec((key.name,), True, self.tombstones)
        self.batch = 0

    def apply(self, changes: list[tuple], start: int, end: int):
        """``changes``: (key, value, change, sequence, offset) in partition t/0, its range [start, end)."""
        self.batch += 1
        key = self.spec.keys[0]
        rows = pa.table({key: [c[0] for c in changes], "v": [c[1] for c in changes],
                         "_sequence": [c[3] for c in changes], "_kafka_topic": ["t"] * len(changes),
                         "_kafka_partition": [0] * len(changes), "_kafka_offset": [c[4] for c in changes],
                         "_kafka_timestamp": [None] * len(changes), CHANGE_COLUMN: [c[2] for c in changes]})
        rows = rows.cast(self.schema.append(pa.field(CHANGE_COLUMN, pa.string())))
        main = Ledger(self.main, "p")
        record = CommitInfo(pipeline="p", run_id="r", batch_seq=self.batch, ranges={"t": {"0": [start, end]}},
                            records={"written": len(changes), "quarantined": 0, "filtered": 0})
        return apply(main, Ledger(self.tombstones, "p"), reduce_changes(rows, self.spec, "p"), self.spec,
                     main.positions([PARTITION]), {PARTITION: end}, [PARTITION], record, "p")

    def rows(self) -> dict:
        return {r[self.spec.keys[0]]: r["v"] for r in DeltaTable(self.main).to_pyarrow_table().to_pylist()}


def test_keys_longer_than_the_statistics_delta_rs_keeps_are_updated_and_deleted(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.string()))
    long, other = "a" * 65, "日本語" * 12
    tables.apply([(long, "one", "upsert", 1, 0), (other, "two", "upsert", 2, 1)], 0, 2)
    outcome, counts = tables.apply([(long, "one-new", "upsert", 3, 2), (other, None, "delete", 4, 3)], 2, 4)
    assert outcome.status == "committed" and (counts["updated"], counts["deleted"]) == (1, 1)
    assert tables.rows() == {long: "one-new"}


def test_a_delete_is_kept_even_where_the_tombstones_positions_are_ahead_after_a_reset(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.int64()))
    tables.apply([(9, "x", "delete", 50, 99)], 99, 100)  # the tombstones table holds t/0 at 100
    main = Ledger(tables.main, "p")
    from oncemore.commit.committer import commit_positions

    commit_positions(main, {PARTITION: 0}, CommitInfo(pipeline="p", run_id="reset", batch_seq=0, ranges={}))
    tables.apply([(7, "seven", "upsert", 10, 0), (7, None, "delete", 20, 1)], 0, 2)
    outcome, counts = tables.apply([(7, "late", "upsert", 15, 2)], 2, 3)  # older than the delete
    assert counts["stale"] == 1 and tables.rows() == {}
    held = {r["id"] for r in DeltaTable(tables.tombstones).to_pyarrow_table().to_pylist()}
    assert held == {7, 9}
