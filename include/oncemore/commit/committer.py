"""One Delta commit of a table: the files the tasks wrote, validated, then committed with the new
positions; or a MERGE of change rows (merge.py), carrying the positions the same way.

The commit is the only place positions move. It re-reads them from a fresh snapshot, refuses to
move them from anything but the expected ones, and puts add actions, txn actions (the moved
positions and every other held one, re-stated) and the commit record in one Delta commit.
delta-rs neither checks txn versions nor validates added files; both are done here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from oncemore.commit.inputs import RangeResult
from oncemore.commit.tablefeatures import check_writable
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import CommitConflict, CommitNotFound, InvalidDataFile, TableOwned, UnsupportedTable
from oncemore.core.storage import filesystem
from oncemore.plan.commitinfo import METADATA_KEY, CommitInfo
from oncemore.plan.ledger import Ledger, fingerprint
from oncemore.write.files import DataFile


@dataclass(frozen=True)
class CommitOutcome:
    status: str  # "committed" | "already_committed" (checked before trying) | "lost_race" (a concurrent commit won)
    version: int | None


def covered_prefix(results: Iterable[RangeResult], starts: Mapping[KafkaPartition, int]
                   ) -> tuple[dict[KafkaPartition, int], list[RangeResult], list[RangeResult]]:
    """Per partition, how far the ranges read reach without a hole from ``starts``, the results
    inside that reach, and the results after a range cut short by its byte budget (never committed)."""
    by_partition: dict[KafkaPartition, list[RangeResult]] = {}
    for result in results:
        by_partition.setdefault(result.key, []).append(result)
    ends, kept, dropped = dict(starts), [], []
    for partition, partition_results in by_partition.items():
        for result in sorted(partition_results, key=lambda r: r.start):
            if result.start != ends[partition]:
                dropped.append(result)
                continue
            kept.append(result)
            ends[partition] = result.reached
    return ends, kept, dropped


def validate_files(table_uri: str, files: list[DataFile], schema: pa.Schema, partition_by: Iterable[str],
                   ranges: Mapping[KafkaPartition, tuple[int, int]] | None,
                   storage_options: Mapping[str, str] | None = None) -> None:
    """Every file exists with its reported size, has the table's schema and holds only offsets
    inside its partition's range (``ranges`` None: a rewrite's files, whose rows keep older
    offsets). delta-rs would commit a broken file without a word."""
    fs, root = filesystem(table_uri, storage_options)
    file_schema = pa.schema([f for f in schema if f.name not in set(partition_by)])
    for data_file in files:
        where = f"{table_uri}/{data_file.path}"
        info = fs.get_file_info(f"{root}/{data_file.path}")
        if info.type != pafs.FileType.File or info.size != data_file.size:
            raise InvalidDataFile(f"{where}: missing or size {info.size} != reported {data_file.size}", path=where)
        found = pq.read_schema(fs.open_input_file(f"{root}/{data_file.path}"))
        if not found.remove_metadata().equals(file_schema, check_metadata=False):
            raise InvalidDataFile(f"{where}: schema {found} differs from the table's {file_schema}", path=where)
        for text, (low, high, _) in sorted(data_file.offsets.items() if ranges is not None else ()):
            start, end = ranges.get(KafkaPartition.parse(text), (0, 0))
            if not (start <= low and high < end):
                raise InvalidDataFile(
                    f"{where}: offsets [{low}, {high}] of {text} fall outside the batch range [{start}, {end})",
                    path=where, partition=text, start=start, end=end,
                )


def commit(
    ledger: Ledger,
    files: list[DataFile],
    expected: Mapping[KafkaPartition, int | None],
    new_positions: Mapping[KafkaPartition, int],
    partitions: Iterable[KafkaPartition],
    record: CommitInfo,
) -> CommitOutcome:
    """One Delta commit: ``files`` plus txn actions moving ``expected`` to ``new_positions`` (and
    re-stating the held positions of the other ``partitions``, the topic's identity and owner).

    Returns already_committed (and commits nothing) when the table's positions already reach
    ``new_positions``: a retry, rerun or concurrent duplicate got there first. Raises
    CommitConflict when they are neither where this commit starts nor where it ends, and
    TableOwned when another pipeline ingests the topic into this table.
    """
    table = ledger.snapshot()
    if held(ledger, table, expected, new_positions):
        return CommitOutcome("already_committed", None)
    read_version = table.version()
    now_ms = int(time.time() * 1000)
    actions = [AddAction(f.path, f.size, json.loads(f.partition_values), now_ms, True, f.stats) for f in files]
    try:
        table.create_write_transaction(
            actions, mode="append", schema=table.schema(),
            partition_by=list(table.metadata().partition_columns) or None,
            commit_properties=properties(ledger, table, new_positions, partitions, record),
        )
    except CommitFailedError as exc:
        return refused_commit(ledger, exc, record, read_version, expected, new_positions)
    return CommitOutcome("committed", version_of(ledger, record, read_version))


def held(ledger: Ledger, table: DeltaTable, expected: Mapping[KafkaPartition, int | None],
         new_positions: Mapping[KafkaPartition, int]) -> bool:
    """What a commit built on ``table`` checks first (check_committable), and whether the table
    already holds ``new_positions`` (True: nothing to commit; see already_committed)."""
    check_committable(ledger, table, {p.topic for p in new_positions})
    return already_committed(ledger, ledger.positions(new_positions, table), expected, new_positions)


def check_committable(ledger: Ledger, table: DeltaTable, topics: Iterable[str]) -> None:
    """The owner of ``topics`` and the table's writability, in the snapshot a commit builds on."""
    check_owner_at_commit(ledger, table, topics)
    # A CHECK constraint another writer added since the run checked the table: delta-rs commits add
    # actions without evaluating one, so the rows would land in breach of it. One added after this
    # snapshot is a metadata change delta-rs's conflict check refuses the commit for.
    check_writable(table, ledger.table_uri)


def merge(ledger: Ledger, table: DeltaTable, source: pa.Table, predicate: str, clauses: Callable,
          expected: Mapping[KafkaPartition, int | None], new_positions: Mapping[KafkaPartition, int],
          partitions: Iterable[KafkaPartition], record: CommitInfo, memory_bytes: int) -> tuple[CommitOutcome, dict]:
    """One Delta MERGE of ``source`` (aliased ``s``) into ``table`` (``t``, the snapshot the caller
    checked with ``held`` and read from), its clauses added by ``clauses(merger)``, carrying the txn
    actions and the record as commit() does; returns the outcome and delta-rs's metrics. A MERGE
    that changes no row makes no commit (delta-rs): the positions are then committed alone."""
    read_version = table.version()
    merger = table.merge(source, predicate, source_alias="s", target_alias="t", streamed_exec=False,
                         max_spill_size=memory_bytes,
                         commit_properties=properties(ledger, table, new_positions, partitions, record))
    try:
        metrics = clauses(merger).execute()
    except CommitFailedError as exc:
        return refused_commit(ledger, exc, record, read_version, expected, new_positions), {}
    if not metrics["num_target_files_added"] and not metrics["num_target_files_removed"]:
        return commit(ledger, [], expected, new_positions, partitions, record), metrics
    return CommitOutcome("committed", version_of(ledger, record, read_version)), metrics


def properties(ledger: Ledger, table: DeltaTable, new_positions, partitions, record: CommitInfo,
               retries: int | None = None) -> CommitProperties:
    """The txn actions and the record of a commit built on ``table``; ``retries``: how often delta-rs
    may rebase it over commits that landed since (None: its default; 0: it lands on ``table`` or not at all)."""
    return CommitProperties(app_transactions=ledger.transactions(new_positions, partitions, table, record),
                            custom_metadata={METADATA_KEY: record.to_json()}, max_commit_retries=retries)


def refused_commit(ledger: Ledger, exc: CommitFailedError, record: CommitInfo, read_version: int, expected,
            new_positions) -> CommitOutcome:
    """What a commit delta-rs refused was: ours after all, lost to a run that got there first, or a conflict."""
    latest = ledger.snapshot()
    # delta-rs retries a commit whose response was lost; the retry then conflicts with its own
    # first attempt, which did land. Ours, whatever the error says.
    mine = ledger.find_commit(record, read_version, latest)
    if mine is not None:
        return CommitOutcome("committed", mine)
    refused_for_features(ledger, exc)
    current = ledger.positions(new_positions, latest)
    if _reached(current, new_positions):
        return CommitOutcome("lost_race", None)
    moves = _moves(expected, current, new_positions)
    raise CommitConflict(
        f"{ledger.table_uri}: " + (f"a concurrent commit moved positions of pipeline {ledger.pipeline} ({moves})"
                                   if moves else "another commit landed on the table first")
        + f"; nothing was committed: {exc}",
        table_uri=ledger.table_uri, expected=dict(expected), found=current, attempted=True,
    ) from exc


def commit_positions(ledger: Ledger, positions: Mapping[KafkaPartition, int], record: CommitInfo,
                     seen: Mapping[KafkaPartition, int | None] | None = None,
                     partitions: Iterable[KafkaPartition] = (), take_over: bool = False) -> int:
    """A commit of no files that sets ``positions`` (a deliberate reset) and re-states the other
    held positions of ``partitions`` as the snapshot it builds on holds them; returns its version.

    ``seen``: the positions the caller's decision (and ``record``) rests on; when the snapshot
    holds others (a run committed meanwhile), nothing is committed (CommitConflict), so a reset
    never undoes a commit it did not see and its record never misstates where it moved from. A
    concurrent commit of the pipeline's positions makes it fail the same way: run it again.
    ``take_over`` lets it make this pipeline the owner of a topic another pipeline ingested."""
    table = ledger.snapshot()
    if not take_over:
        check_owner_at_commit(ledger, table, {p.topic for p in positions})
    if seen is not None:
        current = ledger.positions(seen, table)
        if current != dict(seen):
            raise CommitConflict(
                f"{ledger.table_uri}: positions of pipeline {ledger.pipeline} moved while the reset was being "
                f"prepared ({_moves(seen, current, positions, 'the reset moves it to')}); nothing was committed: "
                "run the reset again",
                table_uri=ledger.table_uri, expected=dict(seen), found=current)
    read_version = table.version()
    properties = CommitProperties(
        app_transactions=ledger.transactions(positions, {*positions, *partitions}, table, record),
        custom_metadata={METADATA_KEY: record.to_json()})
    try:
        table.create_write_transaction([], mode="append", schema=table.schema(),
                                       partition_by=list(table.metadata().partition_columns) or None,
                                       commit_properties=properties)
    except CommitFailedError as exc:
        mine = ledger.find_commit(record, read_version, ledger.snapshot())
        if mine is not None:  # delta-rs's retry of a commit that had landed conflicted with it
            return mine
        refused_for_features(ledger, exc)
        raise CommitConflict(
            f"{ledger.table_uri}: a concurrent commit of pipeline {ledger.pipeline} landed while the reset was "
            f"committing; nothing was committed: run the reset again ({exc})", table_uri=ledger.table_uri,
            attempted=True) from exc
    return version_of(ledger, record, read_version)


def refused_for_features(ledger: Ledger, exc: CommitFailedError) -> None:
    """UnsupportedTable when delta-rs refused a commit for the table's features (another writer
    turned one on after the run checked the table), not for a concurrent commit."""
    if "nsupported table feature" in str(exc):
        raise UnsupportedTable(f"table {ledger.table_uri}: {str(exc).strip().splitlines()[0]}; nothing was committed",
                               table_uri=ledger.table_uri) from exc


def check_owner_at_commit(ledger: Ledger, table: DeltaTable, topics: Iterable[str]) -> None:
    """The owner re-checked in the snapshot a commit builds on (planning checked it too, with
    the owner's name; here a hand-over raced the run)."""
    for topic in sorted(topics):
        owner = ledger.claims(topic, table).owner
        if owner is not None and owner != fingerprint(ledger.pipeline):
            raise TableOwned(
                f"{ledger.table_uri}: topic {topic} was handed over to another pipeline while pipeline "
                f"{ledger.pipeline} was running; nothing was committed", table_uri=ledger.table_uri, topic=topic,
            )


def version_of(ledger: Ledger, record: CommitInfo, read_version: int) -> int:
    """The version our commit got: found by its record among all versions after the one it was
    built on, so commits landing around ours cannot be mistaken for it."""
    version = ledger.find_commit(record, read_version, ledger.snapshot())
    if version is None:
        # Never a CommitConflict: the caller would take the files for uncommitted and delete them.
        raise CommitNotFound(f"{ledger.table_uri}: our commit (run {record.run_id}, batch {record.batch_seq}) is not "
                             f"among the versions after {read_version}", table_uri=ledger.table_uri)
    return version


def _reached(current: Mapping[KafkaPartition, int | None], target: Mapping[KafkaPartition, int]) -> bool:
    return all(current[p] is not None and current[p] >= v for p, v in target.items())


def _moves(expected, current, new_positions, ends: str = "batch ends at") -> str:
    return ", ".join(f"{p}: expected {expected[p]}, found {current[p]}, {ends} {n}"
                     for p, n in sorted(new_positions.items()) if current[p] != expected[p])


def already_committed(ledger: Ledger, current: Mapping[KafkaPartition, int | None],
                      expected: Mapping[KafkaPartition, int | None], new_positions: Mapping[KafkaPartition, int]) -> bool:
    """True when the table's ``current`` positions already reach ``new_positions``; False when
    they are exactly the ``expected`` ones a commit builds on; CommitConflict otherwise."""
    if _reached(current, new_positions):
        return True
    if any(current[p] != expected[p] for p in new_positions):
        raise CommitConflict(
            f"{ledger.table_uri}: positions of pipeline {ledger.pipeline} moved since this batch was read "
            f"({_moves(expected, current, new_positions)}); nothing was committed",
            table_uri=ledger.table_uri, expected=dict(expected), found=dict(current),
        )
    return False


def delete_files(table_uri: str, files: Iterable[DataFile], storage_options: Mapping[str, str] | None = None) -> None:
    """Removes files this run wrote and decided not to commit (never after a commit attempt:
    an attempt that seemed to fail may have landed)."""
    fs, root = filesystem(table_uri, storage_options)
    for data_file in files:
        try:
            fs.delete_file(f"{root}/{data_file.path}")
        except (FileNotFoundError, OSError):
            pass
