"""commit/merge.py on delta-rs alone (no Kafka, no Spark): change rows applied to a table the way a
part's commit applies them, for the cases a run rarely produces on demand: keys whose file
statistics delta-rs truncates, a tombstones table whose positions a rewinding reset left ahead,
a tombstone's rule under sequence_by (it deletes a row of its own partition below it), and
Debezium's placeholder for a value it did not send. Each on both paths of ``upsert.merge``: the
cluster's key scan and copy-on-write run their tasks (write/keyscan.py, write/rewrite.py) in this
process instead of Spark jobs (run/rewritejob.py only ships them); then what only that path does:
partitioned files, a scan or a rewrite that does not add up, a key on two rows, a file compacted
away between the snapshot and the commit."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, WriterProperties, write_deltalake
from deltalake.transaction import AddAction, RemoveAction

from oncemore.commit import merge as merge_module
from oncemore.commit import removable
from oncemore.commit.copyonwrite import ClusterRewrite, RemoveMissed, RewriteMiscount, ScanMiscount
from oncemore.commit.inputs import UpsertSpec
from oncemore.commit.merge import apply, reduce_changes
from oncemore.commit.removable import DELTA_RS_PATH_SAFE, UnremovableFile
from oncemore.core.columns import CHANGE_COLUMN, METADATA_FIELDS, SEQUENCE_FIELD, tombstones_schema
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import CommitConflict, InvalidDataFile, UnsupportedTable
from oncemore.plan.commitinfo import CommitInfo
from oncemore.plan.ledger import Ledger
from oncemore.write.keyscan import ScanResult, ScanTask, SliceRead, scan
from oncemore.write.rewrite import RewriteResult, RewriteTask, rewrite

PARTITION = KafkaPartition("t", 0)
PLACEHOLDER = "__debezium_unavailable_value"
MERGES = pytest.mark.parametrize("merge", ["local", "cluster"])


def in_process(tasks: list[RewriteTask]) -> list[RewriteResult]:
    return [rewrite(t) for t in tasks]


def scanned_in_process(tasks: list[ScanTask]) -> list[ScanResult]:
    return [scan(t) for t in tasks]


class Tables:
    def __init__(self, root, key: pa.Field, sequenced: bool = True, placeholder: str | None = None,
                 merge: str = "local", arrays: bool = False, **create):
        self.main, self.tombstones = str(root / "main"), str(root / "tombstones")
        self.root, self.merge, self.run_rewrite, self.run_scan, self.slots = root, merge, in_process, scanned_in_process, 1
        self.schema = pa.schema([key, pa.field("v", pa.string()), pa.field("blob", pa.binary())]
                                + ([pa.field("tags", pa.list_(pa.string()))] if arrays else [])
                                + ([SEQUENCE_FIELD] if sequenced else []) + METADATA_FIELDS)
        DeltaTable.create(self.main, self.schema, **create)
        DeltaTable.create(self.tombstones, tombstones_schema(pa.schema([key])))
        self.spec = UpsertSpec((key.name,), sequenced, self.tombstones, placeholder)
        self.batch = 0
        self.ends = {0: 0, 1: 0}

    def apply(self, changes: list[tuple], start: int | None = None, end: int | None = None):
        """``changes``: (key, value, change, sequence, offset[, partition[, blob[, tags]]]) in topic t
        (partition 0 unless said); a partition's range runs from where the last one ended (or
        [start, end) for partition 0)."""
        self.batch += 1
        key = self.spec.keys[0]
        part = [c[5] if len(c) > 5 else 0 for c in changes]
        columns = {key: [c[0] for c in changes], "v": [c[1] for c in changes],
                   "blob": [c[6] if len(c) > 6 else None for c in changes]}
        if "tags" in self.schema.names:
            columns["tags"] = [c[7] if len(c) > 7 else None for c in changes]
        if self.spec.sequenced:
            columns["_sequence"] = [c[3] for c in changes]
        rows = pa.table({**columns, "_kafka_topic": ["t"] * len(changes), "_kafka_partition": part,
                         "_kafka_offset": [c[4] for c in changes], "_kafka_timestamp": [None] * len(changes),
                         CHANGE_COLUMN: [c[2] for c in changes]})
        rows = rows.cast(self.schema.append(pa.field(CHANGE_COLUMN, pa.string())))
        ranges = {}
        for p in sorted(set(part) | ({0} if start is not None else set())):
            offsets = [c[4] for c, q in zip(changes, part) if q == p]
            first = start if p == 0 and start is not None else self.ends[p]
            last = end if p == 0 and end is not None else max(offsets) + 1
            ranges[KafkaPartition("t", p)] = (first, last)
            self.ends[p] = last
        main = Ledger(self.main, "p")
        record = CommitInfo(pipeline="p", run_id="r", batch_seq=self.batch,
                            ranges={"t": {str(p.partition): list(r) for p, r in ranges.items()}},
                            records={"written": len(changes), "quarantined": 0, "filtered": 0})
        cluster = (ClusterRewrite(self.run_rewrite, self.run_scan, str(self.root / "staging" / str(self.batch)),
                                  slots=self.slots)
                   if self.merge == "cluster" else None)
        return apply(main, Ledger(self.tombstones, "p"), reduce_changes(rows, self.spec, "p"), self.spec,
                     main.positions(list(ranges)), {p: e for p, (_, e) in ranges.items()}, list(ranges), record, "p",
                     cluster)

    def rows(self, column: str = "v") -> dict:
        return {r[self.spec.keys[0]]: r[column] for r in DeltaTable(self.main).to_pyarrow_table().to_pylist()}

    def held(self) -> dict:
        return {r[self.spec.keys[0]]: (r["_sequence"], r["_kafka_partition"], r["_kafka_offset"])
                for r in DeltaTable(self.tombstones).to_pyarrow_table().to_pylist()}


@MERGES
def test_keys_longer_than_the_statistics_delta_rs_keeps_are_updated_and_deleted(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.string()), merge=merge)
    long, other = "a" * 65, "日本語" * 12
    tables.apply([(long, "one", "upsert", 1, 0), (other, "two", "upsert", 2, 1)], 0, 2)
    outcome, counts = tables.apply([(long, "one-new", "upsert", 3, 2), (other, None, "delete", 4, 3)], 2, 4)
    assert outcome.status == "committed" and (counts["updated"], counts["deleted"]) == (1, 1)
    assert tables.rows() == {long: "one-new"}


@MERGES
def test_a_delete_is_kept_even_where_the_tombstones_positions_are_ahead_after_a_reset(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(9, "x", "delete", 50, 99)], 99, 100)  # the tombstones table holds t/0 at 100
    main = Ledger(tables.main, "p")
    from oncemore.commit.committer import commit_positions

    commit_positions(main, {PARTITION: 0}, CommitInfo(pipeline="p", run_id="reset", batch_seq=0, ranges={}))
    tables.apply([(7, "seven", "upsert", 10, 0), (7, None, "delete", 20, 1)], 0, 2)
    outcome, counts = tables.apply([(7, "late", "upsert", 15, 2)], 2, 3)  # older than the delete
    assert counts["stale"] == 1 and tables.rows() == {}
    held = {r["id"] for r in DeltaTable(tables.tombstones).to_pyarrow_table().to_pylist()}
    assert held == {7, 9}


@MERGES
def test_a_tombstone_deletes_the_row_of_its_partition_below_it_and_keeps_the_delete_against_older_events(tmp_path, merge):
    """A compacted topic's d is gone, its tombstone is left: it deletes the row that came from its
    partition at a lower offset, and the delete holds the row's sequence at its coordinates."""
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(1, "one", "upsert", 10, 0), (2, "two", "upsert", 20, 1), (3, "three", "upsert", 30, 0, 1)])
    _, counts = tables.apply([(1, None, "tombstone", None, 3),  # the d at offset 2 was compacted away
                              (3, None, "tombstone", None, 4),  # its row came from partition 1: no delete
                              (2, None, "tombstone", None, 1, 1)])  # partition 1's tombstone, row from partition 0
    assert tables.rows() == {2: "two", 3: "three"}
    assert (counts["deleted"], counts["tombstones"], counts["stale"]) == (1, 2, 0), counts
    assert tables.held() == {1: (10, 0, 3)}
    _, counts = tables.apply([(1, "late", "upsert", 9, 5, 1)])  # older than the deleted row
    assert tables.rows() == {2: "two", 3: "three"} and counts["stale"] == 1
    _, counts = tables.apply([(1, "again", "upsert", 11, 6)])
    assert tables.rows() == {1: "again", 2: "two", 3: "three"} and counts["inserted"] == 1


@MERGES
def test_a_tombstone_after_the_parts_own_event_deletes_it_and_an_earlier_one_does_not(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    _, counts = tables.apply([(1, "one", "upsert", 10, 0), (1, None, "tombstone", None, 1),
                              (2, None, "tombstone", None, 2), (2, "two", "upsert", 5, 3),
                              (3, "three", "upsert", 7, 4), (3, None, "tombstone", None, 5),
                              (3, "three-b", "upsert", 8, 6, 1)])  # newer, from another partition: it stays
    assert tables.rows() == {2: "two", 3: "three-b"}
    assert {k: counts[k] for k in ("inserted", "noop_deletes", "superseded", "tombstones")} == {
        "inserted": 2, "noop_deletes": 1, "superseded": 2, "tombstones": 2}, counts
    assert tables.held() == {1: (10, 0, 1)}


@MERGES
def test_a_row_whose_sequence_was_cleared_loses_to_any_event(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(1, "one", "upsert", 10, 0)])
    DeltaTable(tables.main).update({"_sequence": "NULL"})
    _, counts = tables.apply([(1, "new era", "upsert", 1, 1, 1)])
    assert tables.rows() == {1: "new era"} and counts["updated"] == 1


@MERGES
@pytest.mark.parametrize("sequenced", [True, False], ids=["sequence_by", "offsets"])
def test_a_placeholder_keeps_the_stored_value_and_an_unknown_one_is_null_and_counted(tmp_path, sequenced, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), sequenced=sequenced, placeholder=PLACEHOLDER,
                    merge=merge)
    big, raw = "x" * 5000, PLACEHOLDER.encode()
    tables.apply([(1, big, "upsert", 1, 0, 0, b"blob-1"), (2, "two", "upsert", 2, 1, 0, b"blob-2")])
    _, counts = tables.apply([(1, PLACEHOLDER, "upsert", 3, 2, 0, raw),  # both unchanged: the stored values
                              (2, "two-b", "upsert", 4, 3, 0, raw),
                              (2, PLACEHOLDER, "upsert", 5, 4, 0, b"blob-2b"),  # the earlier event's value
                              (3, PLACEHOLDER, "upsert", 6, 5, 0, b"blob-3"),  # nothing holds its value
                              (4, "four", "upsert", 7, 6), (4, None, "delete", 8, 7),
                              (4, PLACEHOLDER, "upsert", 9, 8)])  # after its delete: unknown
    assert tables.rows() == {1: big, 2: "two-b", 3: None, 4: None}
    assert tables.rows("blob") == {1: b"blob-1", 2: b"blob-2b", 3: b"blob-3", 4: None}
    assert counts["unavailable"] == 2 and counts["updated"] == 2 and counts["inserted"] == 2, counts


@MERGES
@pytest.mark.parametrize("sequenced", [True, False], ids=["sequence_by", "offsets"])
def test_a_placeholder_in_an_array_column_keeps_the_stored_array(tmp_path, sequenced, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), sequenced=sequenced, placeholder=PLACEHOLDER,
                    merge=merge, arrays=True)
    tables.apply([(1, "one", "upsert", 1, 0, 0, None, ["a", "b"]), (4, "four", "upsert", 1, 1, 0, None, ["d"])])
    tables.apply([(2, "two", "upsert", 2, 2, 0, None, ["c"])])  # a second file: the scan's second slice
    _, counts = tables.apply([(2, "two-b", "upsert", 3, 3, 0, None, [PLACEHOLDER]),  # the stored array
                              (3, "three", "upsert", 4, 4, 0, None, [PLACEHOLDER])])  # nothing holds it
    assert tables.rows("tags") == {1: ["a", "b"], 2: ["c"], 3: None, 4: ["d"]}
    assert tables.rows() == {1: "one", 2: "two-b", 3: "three", 4: "four"}
    assert counts["unavailable"] == 1 and counts["updated"] == 1 and counts["inserted"] == 1, counts


def test_on_the_cluster_this_process_reads_neither_the_table_nor_its_tombstones(tmp_path, monkeypatch):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), placeholder=PLACEHOLDER, merge="cluster", arrays=True)
    tables.apply([(1, "one", "upsert", 1, 0, 0, b"blob-1", ["a"]), (2, "two", "upsert", 2, 1)])
    tables.apply([(2, None, "delete", 3, 2)])
    monkeypatch.setattr(merge_module, "read", lambda *args: pytest.fail(f"read here: {args[0]}"))
    scanned = []
    tables.run_scan = lambda tasks: scanned.extend({t.table_uri for t in tasks}) or scanned_in_process(tasks)
    _, counts = tables.apply([(1, PLACEHOLDER, "upsert", 4, 3, 0, PLACEHOLDER.encode(), [PLACEHOLDER]),
                              (2, "late", "upsert", 2, 4)])  # older than the delete the tombstones table holds
    assert {uri.rstrip("/").rsplit("/", 1)[1] for uri in scanned} == {"main", "tombstones"}
    assert tables.rows() == {1: "one"} and tables.rows("tags") == {1: ["a"]} and tables.rows("blob") == {1: b"blob-1"}
    assert (counts["updated"], counts["stale"], counts["unavailable"]) == (1, 1, 0), counts


@MERGES
def test_a_placeholders_stored_value_is_read_for_the_keys_that_need_it_alone(tmp_path, monkeypatch, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), placeholder=PLACEHOLDER, merge=merge)
    tables.apply([(k, "x" * 1000, "upsert", k, k - 1) for k in range(1, 6)])
    name = "scan_keys" if merge == "cluster" else "read"
    real, asked = getattr(merge_module, name), []

    def counted(table, *args):  # read(table, keys, probe, columns, like); scan_keys(table, probe, keys, columns, ...)
        probe, columns = (args[1], args[2]) if name == "read" else (args[0], args[2])
        asked.append((probe.num_rows, tuple(columns)))
        return real(table, *args)

    monkeypatch.setattr(merge_module, name, counted)
    _, counts = tables.apply([(k, PLACEHOLDER if k == 3 else f"new {k}", "upsert", 10 + k, 4 + k) for k in range(1, 6)])
    assert tables.rows() == {1: "new 1", 2: "new 2", 3: "x" * 1000, 4: "new 4", 5: "new 5"}
    assert [probed for probed, columns in asked if "v" in columns] == [1], asked  # key 3's value, no other
    assert counts["updated"] == 5, counts


@MERGES
def test_a_tombstones_table_with_deletion_vectors_is_refused_before_any_commit(tmp_path, merge):
    from deltalake import TableFeatures

    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(1, "one", "upsert", 1, 0), (1, None, "delete", 2, 1)])
    DeltaTable(tables.tombstones).alter.add_feature([TableFeatures.DeletionVectors],
                                                    allow_protocol_versions_increase=True)
    versions = DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()
    with pytest.raises(UnsupportedTable, match="tombstones has the deletionVectors feature.*DROP FEATURE deletionVectors"):
        tables.apply([(1, "late", "upsert", 1, 2)])
    assert (DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()) == versions


def unreferenced(table_uri: str) -> set[str]:
    """The Parquet files under the table that its current version does not reference."""
    referenced = {unquote(p) for p in pa.table(DeltaTable(table_uri).get_add_actions()).column("path").to_pylist()}
    return {str(p.relative_to(table_uri)) for p in Path(table_uri).rglob("*.parquet")} - referenced


def test_on_the_cluster_a_partitioned_table_keeps_each_row_in_its_partition_and_one_commit_moves_it(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.string()), merge="cluster", partition_by=["id"])
    odd = "a b/c%d=é"  # escaped in the directory's name and the log's path
    tables.apply([(odd, "one", "upsert", 1, 0), ("k2", "two", "upsert", 2, 1), ("k3", "three", "upsert", 3, 2)])
    before = DeltaTable(tables.main).version()
    outcome, counts = tables.apply([(odd, "one-b", "upsert", 4, 3), ("k2", None, "delete", 5, 4),
                                    ("k4", "four", "upsert", 6, 5)])
    assert outcome.status == "committed" and outcome.version == before + 1
    assert {k: counts[k] for k in ("inserted", "updated", "deleted")} == {"inserted": 1, "updated": 1, "deleted": 1}
    assert tables.rows() == {odd: "one-b", "k3": "three", "k4": "four"}
    (commit,) = DeltaTable(tables.main).history(1)
    assert Ledger(tables.main, "p").positions([PARTITION])[PARTITION] == 6 and commit["operation"] == "WRITE"
    adds = pa.table(DeltaTable(tables.main).get_add_actions(flatten=True))
    assert sorted(adds.column("partition.id").to_pylist()) == sorted([odd, "k3", "k4"])
    actions = [json.loads(line) for line in Path(tables.main, "_delta_log", f"{before + 1:020d}.json").read_text().splitlines()]
    removed = sorted(unquote(a["remove"]["path"]).split("/")[0] for a in actions if "remove" in a)
    added = sorted(unquote(a["add"]["path"]).split("/")[0] for a in actions if "add" in a)
    assert (removed, added) == (["id=a b%2Fc%25d%3Dé", "id=k2"], ["id=a b%2Fc%25d%3Dé", "id=k4"])  # k2's file: no row left
    assert len(unreferenced(tables.main)) == 2  # the removed files, until vacuum


def test_a_rewrite_that_does_not_add_up_commits_nothing_and_deletes_the_files_it_wrote(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), sequenced=False, merge="cluster")
    tables.apply([(1, "one", "upsert", None, 0), (2, "two", "upsert", None, 1)])
    version, files = DeltaTable(tables.main).version(), unreferenced(tables.main)
    tables.run_rewrite = lambda tasks: [RewriteResult(r.read, r.dropped - 1, r.added, r.files)
                                        for r in in_process(tasks)]  # a row it says it kept, lost
    with pytest.raises(RewriteMiscount, match=r"task 0: read 2, dropped 0 \(keys held 1\), added 1"):
        tables.apply([(1, "one-b", "upsert", None, 2)])
    assert DeltaTable(tables.main).version() == version and unreferenced(tables.main) == files
    assert tables.rows() == {1: "one", 2: "two"}


def test_a_file_compacted_between_the_snapshot_and_the_commit_refuses_the_commit(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), sequenced=False, merge="cluster")
    tables.apply([(1, "one", "upsert", None, 0)])
    tables.apply([(2, "two", "upsert", None, 1)])

    def compacting(tasks):
        DeltaTable(tables.main).optimize.compact()  # another writer, while the tasks run
        return in_process(tasks)

    tables.run_rewrite = compacting
    with pytest.raises(CommitConflict, match=r"another commit landed on the table first; nothing was committed"):
        tables.apply([(1, "one-b", "upsert", None, 2)])
    assert tables.rows() == {1: "one", 2: "two"}
    assert Ledger(tables.main, "p").positions([PARTITION])[PARTITION] == 2


@MERGES
def test_an_append_only_table_is_refused_before_any_commit_with_a_way_out_that_works(tmp_path, merge):
    # Locally, delta-rs's MERGE inserted, then failed the first update as a commit conflict, on every rerun.
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(1, "one", "upsert", 1, 0)])
    DeltaTable(tables.main).alter.set_table_properties({"delta.appendOnly": "true"})
    versions = DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()
    with pytest.raises(UnsupportedTable, match="is append-only.*SET TBLPROPERTIES .'delta.appendOnly' = 'false'."):
        tables.apply([(1, "one-b", "upsert", 2, 1)])
    assert (DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()) == versions
    DeltaTable(tables.main).alter.set_table_properties({"delta.appendOnly": "false"})
    tables.apply([(1, "one-b", "upsert", 2, 1)])
    assert tables.rows() == {1: "one-b"}


@MERGES
def test_a_table_with_deletion_vectors_is_refused_before_any_commit(tmp_path, merge):
    # Locally, delta-rs refused to read it, untyped; the cluster's refusal named upsert.merge local as the way out.
    from deltalake import TableFeatures

    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(1, "one", "upsert", 1, 0)])
    DeltaTable(tables.main).alter.add_feature([TableFeatures.DeletionVectors], allow_protocol_versions_increase=True)
    versions = DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()
    with pytest.raises(UnsupportedTable, match="main has the deletionVectors feature.*DROP FEATURE deletionVectors"):
        tables.apply([(1, "one-b", "upsert", 2, 1)])
    assert (DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()) == versions


@MERGES
def test_a_table_recording_its_change_data_feed_takes_a_local_merge_and_refuses_the_clusters(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    tables.apply([(1, "one", "upsert", 1, 0)])
    DeltaTable(tables.main).alter.set_table_properties({"delta.enableChangeDataFeed": "true"})
    if merge == "cluster":
        with pytest.raises(UnsupportedTable, match="records the change data feed.*use upsert.merge local"):
            tables.apply([(1, "one-b", "upsert", 2, 1)])
        assert tables.rows() == {1: "one"}
        return
    tables.apply([(1, "one-b", "upsert", 2, 1)])
    assert tables.rows() == {1: "one-b"} and list(Path(tables.main).glob("_change_data/*.parquet"))



def test_on_the_cluster_a_table_partitioned_by_a_timestamp_key_rewrites_the_files_of_its_partitions(tmp_path):
    at = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc)
    later = at + timedelta(hours=1)
    tables = Tables(tmp_path, pa.field("at", pa.timestamp("us", "UTC")), merge="cluster", partition_by=["at"])
    tables.apply([(at, "one", "upsert", 1, 0), (later, "two", "upsert", 2, 1)])
    _, counts = tables.apply([(at, "one-b", "upsert", 3, 2), (later, None, "delete", 4, 3)])
    assert (counts["updated"], counts["deleted"]) == (1, 1) and tables.rows() == {at: "one-b"}
    assert len(unreferenced(tables.main)) == 2  # both partitions' files were rewritten (the second to nothing)


def test_delta_rs_escapes_a_remove_actions_path_as_the_cluster_path_expects(tmp_path):
    table_uri = str(tmp_path / "t")
    DeltaTable.create(table_uri, pa.schema([pa.field("x", pa.int64())]))
    paths = [f"p{c}q/f" for c in "".join(map(chr, range(32, 127))) + "\té日"]
    table = DeltaTable(table_uri)
    table.create_write_transaction([RemoveAction(p, True, 1, 1, {}) for p in paths], mode="append",
                                   schema=table.schema())
    log = [json.loads(line) for line in Path(table_uri, "_delta_log", f"{1:020d}.json").read_text().splitlines()]
    assert [a["remove"]["path"] for a in log if "remove" in a] == [quote(p, safe=DELTA_RS_PATH_SAFE) for p in paths]


def foreign_table(tmp_path, escaped, merge: str = "cluster", sequenced: bool = False) -> Tables:
    """A table partitioned by its key whose file of key "é" another writer added, in directory
    ``id=é``, its log path escaped by ``escaped``, beside a file of key "a" delta-rs added."""
    tables = Tables(tmp_path, pa.field("id", pa.string()), sequenced=sequenced, merge="cluster", partition_by=["id"])
    tables.apply([("é", "one", "upsert", 1, 0)])  # the cluster's writer: in id=é, its log path id=%C3%A9
    tables.merge = merge
    log = Path(tables.main, "_delta_log", f"{1:020d}.json")
    actions = [json.loads(line) for line in log.read_text().splitlines()]
    for action in actions:
        if "add" in action:
            action["add"]["path"] = escaped(action["add"]["path"])
    log.write_text("".join(json.dumps(a, ensure_ascii=False) + "\n" for a in actions))
    tables.apply([("a", "two", "upsert", 1, 1)])
    return tables


def as_delta_spark_writes(path: str) -> str:
    return path.replace("%C3%A9", "é")


@MERGES
def test_a_changed_key_in_a_file_whose_path_another_writer_spelled_otherwise_is_refused_before_any_commit(tmp_path,
                                                                                                         merge):
    """delta-rs's own MERGE (the local path) left the old row live beside the new one, and said updated: 1."""
    tables = foreign_table(tmp_path, as_delta_spark_writes, merge)
    with pytest.raises(UnremovableFile, match=r"^pipeline p \(t/0 offsets \[2, 3\)\): .* version 2: file id=é/.*"
                                              r"would leave it live.*nothing was committed.*randomizeFilePrefixes"):
        tables.apply([("é", "one-b", "upsert", None, 2)])
    assert DeltaTable(tables.main).version() == 2 and tables.rows() == {"é": "one", "a": "two"}
    assert Ledger(tables.main, "p").positions([PARTITION])[PARTITION] == 2
    # The keys in files delta-rs can remove go on.
    _, counts = tables.apply([("a", "two-b", "upsert", None, 2), ("b", "new", "upsert", None, 3)])
    assert (counts["updated"], counts["inserted"]) == (1, 1)
    assert tables.rows() == {"é": "one", "a": "two-b", "b": "new"}


def test_resequence_refuses_a_table_holding_a_file_delta_rs_cannot_remove_before_changing_anything(tmp_path):
    """Its UPDATE clearing the sequences left the file live beside its rewrite (checked with delta-spark 4.4)."""
    from oncemore.config.loading import load_pipeline
    from oncemore.ops.resequence import resequence

    tables = foreign_table(tmp_path, as_delta_spark_writes, sequenced=True)
    config = tmp_path / "p.yaml"
    config.write_text(json.dumps({
        "name": "p", "source": {"bootstrap_servers": "localhost:9", "topic": "t"}, "sink": {"table_uri": tables.main,
        "partition_by": ["id"]}, "format": {"type": "json", "schema": "id STRING, v STRING, blob BINARY, n BIGINT"},
        "upsert": {"keys": ["id"], "sequence_by": "n"}}))
    version = DeltaTable(tables.main).version()
    with pytest.raises(UnremovableFile, match=r"^pipeline p: resequence: table .*: file id=é/.*nothing was changed"):
        resequence(load_pipeline(config))
    assert DeltaTable(tables.main).version() == version and tables.rows("_sequence") == {"é": 1, "a": 1}


def test_on_the_cluster_a_removed_file_left_live_fails_the_part_loudly(tmp_path, monkeypatch):
    """The refusal above disabled: the commit's remove misses the file, and the run says so."""
    tables = foreign_table(tmp_path, as_delta_spark_writes)
    monkeypatch.setattr(removable, "quote", lambda path, safe: path.replace("%C3%A9", "é"))
    with pytest.raises(RemoveMissed, match=r"pipeline p \(t/0 offsets \[2, 3\)\).* version 3: .*left id=é/"):
        tables.apply([("é", "one-b", "upsert", None, 2)])


def test_on_the_cluster_a_file_holding_its_partition_column_takes_the_logs_value(tmp_path):
    """delta-spark writes a partition column into the file too."""
    tables = Tables(tmp_path, pa.field("id", pa.string()), sequenced=False, merge="cluster", partition_by=["id"])
    rows = pa.table({"id": ["k", "k2"], "v": ["one", "two"], "blob": [None, None], "_kafka_topic": ["t", "t"],
                     "_kafka_partition": [0, 0], "_kafka_offset": [0, 1], "_kafka_timestamp": [None, None]},
                    schema=tables.schema)
    table = DeltaTable(tables.main)
    adds = []
    for key in ("k", "k2"):
        Path(tables.main, f"id={key}").mkdir()
        pq.write_table(rows.filter(pa.compute.equal(rows.column("id"), key)), f"{tables.main}/id={key}/spark.parquet")
        adds.append(AddAction(f"id={key}/spark.parquet", Path(tables.main, f"id={key}/spark.parquet").stat().st_size,
                              {"id": key}, 1, True, None))
    table.create_write_transaction(adds, mode="append", schema=table.schema(), partition_by=["id"])
    tables.ends[0] = 2
    _, counts = tables.apply([("k", "one-b", "upsert", None, 2), ("k2", None, "delete", None, 3)])
    assert (counts["updated"], counts["deleted"]) == (1, 1) and tables.rows() == {"k": "one-b"}


def test_a_refused_rewrite_under_sequence_by_commits_no_tombstone_and_names_the_part(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge="cluster")
    tables.apply([(1, "one", "upsert", 1, 0), (2, "two", "upsert", 2, 1)])
    held_version = DeltaTable(tables.tombstones).version()
    tables.run_rewrite = lambda tasks: [RewriteResult(r.read, r.dropped - 1, r.added, r.files)
                                        for r in in_process(tasks)]
    with pytest.raises(RewriteMiscount, match=r"^pipeline p \(t/0 offsets \[2, 3\)\): .*nothing was committed to the "
                                              r"table or its tombstones table$"):
        tables.apply([(2, None, "delete", 3, 2)])
    assert DeltaTable(tables.tombstones).version() == held_version and tables.held() == {}
    assert tables.rows() == {1: "one", 2: "two"}


def two_files(tmp_path) -> Tables:
    tables = Tables(tmp_path, pa.field("id", pa.int64()), sequenced=False, merge="cluster")
    tables.apply([(1, "one", "upsert", None, 0)])
    tables.apply([(2, "two", "upsert", None, 1)])
    tables.slots = 2  # a task per file
    return tables


def test_tasks_whose_rows_add_up_only_together_are_refused(tmp_path):
    tables = two_files(tmp_path)
    version, files = DeltaTable(tables.main).version(), unreferenced(tables.main)

    def swapped(tasks):  # the first task drops a row more, the second one less: the totals agree
        first, second = in_process(tasks)
        return [RewriteResult(first.read + 1, first.dropped + 1, first.added, first.files),
                RewriteResult(second.read - 1, second.dropped - 1, second.added, second.files)]

    tables.run_rewrite = swapped
    with pytest.raises(RewriteMiscount, match=r"task 0: read 2, dropped 2 \(keys held 1\)"):
        tables.apply([(1, "one-b", "upsert", None, 2), (2, "two-b", "upsert", None, 3)])
    assert DeltaTable(tables.main).version() == version and unreferenced(tables.main) == files


def test_a_rewritten_file_that_is_not_there_is_refused_before_the_commit(tmp_path):
    tables = two_files(tmp_path)
    version = DeltaTable(tables.main).version()

    def losing(tasks):
        results = in_process(tasks)
        Path(tables.main, results[0].files[0].path).unlink()
        return results

    tables.run_rewrite = losing
    with pytest.raises(InvalidDataFile, match=r"pipeline p \(t/0 offsets \[2, 4\)\).*missing.*nothing was committed"):
        tables.apply([(1, "one-b", "upsert", None, 2), (2, "two-b", "upsert", None, 3)])
    assert DeltaTable(tables.main).version() == version and tables.rows() == {1: "one", 2: "two"}


def recording(tables: Tables) -> list[list[ScanTask]]:
    """The scan tasks each part's key scan ran, recorded as the tasks run in this process."""
    runs: list[list[ScanTask]] = []
    tables.run_scan = lambda tasks: runs.append(tasks) or scanned_in_process(tasks)
    return runs


def test_on_the_cluster_a_file_the_key_scan_read_short_refuses_the_part_before_any_commit(tmp_path):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge="cluster")
    tables.apply([(1, "one", "upsert", 1, 0), (2, "two", "upsert", 2, 1)])
    versions = DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()
    (path,) = [unquote(p) for p in pa.table(DeltaTable(tables.main).get_add_actions()).column("path").to_pylist()]

    def short(tasks):  # a row group the task skipped, its rows not read and not reported
        return [ScanResult(tuple(SliceRead(s.file, s.part, s.read - 1, s.rows) for s in r.slices), r.found, r.found_path)
                for r in scanned_in_process(tasks)]

    tables.run_scan = short
    with pytest.raises(ScanMiscount, match=rf"^pipeline p \(t/0 offsets \[2, 3\)\): .* version 1: the cluster's key scan "
                                           rf".*file {path}: read 1 of its 2 rows.*nothing was committed to the table or "
                                           r"its tombstones table$"):
        tables.apply([(2, None, "delete", 3, 2)])
    assert (DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()) == versions
    assert tables.rows() == {1: "one", 2: "two"} and tables.held() == {}


@pytest.mark.parametrize("sequenced", [True, False], ids=["sequence_by", "offsets"])
def test_on_the_cluster_a_key_on_two_rows_in_files_two_scan_tasks_read_is_refused(tmp_path, sequenced):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), sequenced=sequenced, merge="cluster")
    tables.apply([(1, "one", "upsert", 1, 0)])
    row = DeltaTable(tables.main).to_pyarrow_table()
    write_deltalake(tables.main, row, mode="append")  # another writer's copy of the row: the key on two rows
    tables.apply([(2, "two", "upsert", 2, 1)])
    versions = DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()
    tables.slots = 2
    runs = recording(tables)
    with pytest.raises(RewriteMiscount, match=r"^pipeline p \(t/0 offsets \[2, 3\)\): .*: key \{\"id\": 1\} is on two rows "
                                              r"of the table; nothing was committed"):
        tables.apply([(1, "one-b", "upsert", 3, 2)])
    (tasks,) = runs
    holding = [{s.file for s in t.slices} for t in tasks]
    assert len(tasks) == 2 and all(holding) and not holding[0] & holding[1]  # each file in one task, two tasks
    assert (DeltaTable(tables.main).version(), DeltaTable(tables.tombstones).version()) == versions


def preloaded(tables: Tables, count: int, **write) -> list[int]:
    """``count`` rows written into ``tables``' main table by delta-rs alone (ids 1.., their
    sequence the id, each from partition id % 2 at offset id), positions set past them."""
    ids = list(range(1, count + 1))
    write_deltalake(tables.main, pa.table({
        "id": ids, "v": [f"v{i}" for i in ids], "blob": [None] * count, "_sequence": ids, "_kafka_topic": ["t"] * count,
        "_kafka_partition": [i % 2 for i in ids], "_kafka_offset": ids, "_kafka_timestamp": [None] * count,
    }).cast(tables.schema), mode="append", **write)
    tables.ends = {0: count + 1, 1: count + 1}
    return ids


def a_mixed_part(tables: Tables, ids: list[int]) -> None:
    """An update, a tombstone that deletes (its row came from its partition), one that does not,
    a delete, an insert and a stale event, applied; the table and the held deletes checked."""
    last = len(ids)
    _, counts = tables.apply([(3, "three-b", "upsert", 50, last + 1, 1),
                              (4, None, "tombstone", None, last + 2, 0),  # its row came from partition 0: deleted
                              (5, None, "tombstone", None, last + 3, 0),  # its row came from partition 1: kept
                              (last - 2, None, "delete", 60, last + 4, 0), (last + 1, "new", "upsert", 70, last + 5, 0),
                              (last - 5, "late", "upsert", 1, last + 6, 0)])  # older than the row: stale
    assert tables.rows() == {i: f"v{i}" for i in ids if i not in (4, last - 2)} | {3: "three-b", last + 1: "new"}
    assert {k: counts[k] for k in ("inserted", "updated", "deleted", "stale", "tombstones")} == {
        "inserted": 1, "updated": 1, "deleted": 2, "stale": 1, "tombstones": 1}, counts
    assert tables.held() == {4: (4, 0, last + 2), last - 2: (60, 0, last + 4)}


@MERGES
def test_the_key_scan_splits_a_file_by_its_row_groups_over_its_tasks_and_classifies_as_the_local_path(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge)
    ids = preloaded(tables, 40, writer_properties=WriterProperties(max_row_group_size=4))  # one file, 10 row groups
    tables.slots = 3
    runs = recording(tables)
    a_mixed_part(tables, ids)
    if merge == "cluster":
        (tasks,) = runs
        assert len(tasks) == 3 and sorted(s.part for t in tasks for s in t.slices) == [0, 1, 2]


@MERGES
def test_a_table_partitioned_by_its_key_is_scanned_by_several_tasks_and_classified_as_the_local_path(tmp_path, merge):
    tables = Tables(tmp_path, pa.field("id", pa.int64()), merge=merge, partition_by=["id"])
    ids = preloaded(tables, 12, partition_by=["id"])  # a file per key, its key in the log only
    tables.slots = 3
    runs = recording(tables)
    a_mixed_part(tables, ids)
    if merge == "cluster":
        (tasks,) = runs
        assert len(tasks) == 3 and all(len(t.slices) == 4 for t in tasks)
