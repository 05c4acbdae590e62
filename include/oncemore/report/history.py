"""A pipeline's committed history as ``oncemore verify`` reads it: the kept commits' ranges cut into
pieces each covered by the same commits, the offsets recorded deletions removed since, and a
snapshot's files as scan tasks (tablescan.py).

Invariant: the pieces of one partition never overlap, and every offset of a kept commit's range
lies in exactly one piece, which names every commit that covers it (more than one where a reset
rewound the partition and the offsets were ingested again).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from oncemore.core.coordinates import KafkaPartition, flat
from oncemore.core.errors import OncemoreError
from oncemore.plan.commitinfo import CommitEntry

if TYPE_CHECKING:  # tablescan imports PySpark: the oncemore page reads results without it
    from oncemore.report.tablescan import Coverage

TASK_BYTES = 128 << 20  # Parquet bytes per Spark task

# A snapshot's file: (quarantine, table root, path, its partition values as text, the positions of
# its rows a deletion vector deletes, size, the index of its table among the audited ones).
File = tuple[bool, str, str, dict, list[int], int, int]


@dataclass(frozen=True)
class Piece:
    """A stretch of one partition's offsets that the same commits cover."""

    partition: KafkaPartition
    start: int
    end: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class Removals:
    """Rows that left the tables after their batches, by table (main, quarantine): the offsets
    ``oncemore delete`` recorded removing, and the commits that removed rows without a record."""

    deleted: dict[str, dict[KafkaPartition, list[tuple[int, int]]]]
    outside: dict[str, list[tuple[int, str]]]  # (version, operation)

    def within(self, what: str, p: KafkaPartition, start: int, end: int) -> int:
        """How many offsets of [start, end) of ``p`` a recorded deletion removed from table ``what``."""
        return sum(max(0, min(e, end) - max(s, start)) for s, e in self.deleted[what].get(p, []))


def deleted_spans(entries: list[CommitEntry]) -> dict[KafkaPartition, list[tuple[int, int]]]:
    """The offsets the deletions among ``entries`` recorded removing, per partition."""
    spans: dict[KafkaPartition, list[tuple[int, int]]] = {}
    for entry in entries:
        if entry.record.deletion is not None:
            for p, runs in entry.record.deletion.spans().items():
                spans.setdefault(p, []).extend(runs)
    return spans


def coverage(history: list[CommitEntry], held, whole_log: bool, topics: set[str]) -> tuple[dict[int, Piece], Coverage]:
    """The ranges of every kept commit cut into pieces each covered by the same commits (all of
    them: a range rewound by a reset overlaps older ones, audited or not), numbered; what the
    table scan needs to place each row in one."""
    from oncemore.report.tablescan import OUTSIDE, Coverage

    ranges: dict[KafkaPartition, list[tuple[int, int, int]]] = {}
    placed: dict[KafkaPartition, int] = {}  # where a reset first placed a partition this pipeline had not read
    for entry in history:
        if entry.record.reset is not None:
            for p, to in flat(entry.record.reset.to_positions).items():
                if p not in ranges and p not in placed and to is not None:
                    placed[p] = to
        for p, (start, end) in entry.record.partition_ranges().items():
            if start < end:
                ranges.setdefault(p, []).append((start, end, entry.version))
    pieces: dict[int, Piece] = {}
    partitions = {}
    for p in set(ranges) | set(held):
        spans = ranges.get(p, [])
        bounds = sorted({b for start, end, _ in spans for b in (start, end)})
        covering: list[list[int]] = [[] for _ in bounds[1:]]
        for start, end, version in spans:
            for k in range(bisect.bisect_left(bounds, start), bisect.bisect_left(bounds, end)):
                covering[k].append(version)
        segments = []
        for k, versions in enumerate(covering):
            if versions:
                segments.append(len(pieces))
                pieces[len(pieces)] = Piece(p, bounds[k], bounds[k + 1], tuple(versions))
            else:
                segments.append(OUTSIDE)
        # Below the first kept range, rows of commits the log no longer keeps (unless it keeps them
        # all); below where a reset first placed the partition (a take-over, a start on a table that
        # held rows), rows that were never this pipeline's to account for.
        start = placed.get(p) if whole_log else min((s for s, _, _ in spans), default=held.get(p))
        partitions[str(p)] = {"bounds": bounds, "segments": segments, "start": start, "position": held.get(p)}
    return pieces, Coverage(partitions, tuple(sorted(topics)), whole_log)


def versions_at(pieces: dict[int, Piece], p: KafkaPartition, offset: int) -> tuple[int, ...]:
    """The commits whose ranges hold ``offset`` of ``p`` (none: outside the kept history)."""
    return next((piece.versions for piece in pieces.values()
                 if piece.partition == p and piece.start <= offset < piece.end), ())


def snapshot_files(quarantine: bool, table, table_uri: str, index: int | None = None) -> list[File]:
    """The snapshot's files (``File``); partition values as text, as the paths hold them. ``index``:
    the table's among the audited ones (default: 0 for the main table, 1 for the quarantine table)."""
    from urllib.parse import unquote

    import pyarrow as pa

    # Rows deleted by another engine's deletion vectors (delta-spark's DELETE, with the feature on)
    # are gone from the table though their files stay: they are skipped by position, never read.
    vectors = pa.table(table.deletion_vectors()).to_pydict()
    deleted = {unquote(uri): [i for i, keep in enumerate(mask) if not keep]
               for uri, mask in zip(vectors.get("filepath", []), vectors.get("selection_vector", []))}
    actions = pa.table(table.get_add_actions(flatten=False)).to_pydict()
    values = actions.get("partition") or [None] * len(actions["path"])
    index = int(quarantine) if index is None else index
    found = [(quarantine, table_uri, path, {k: None if v is None else str(v) for k, v in (parts or {}).items()},
              [], size, index)
             for path, parts, size in zip(actions["path"], values, actions["size_bytes"])]
    for uri, rows in deleted.items():
        matching = [f for f in found if uri.endswith("/" + unquote(f[2]).lstrip("/"))]
        if len(matching) != 1:
            raise OncemoreError(f"{table_uri}: a deletion vector of {uri} matches {len(matching)} of the snapshot's "
                                "files: verify cannot tell which rows are deleted")
        matching[0][4].extend(rows)
    return found


def scan_tasks(files: list[File], slots: int) -> list[list[tuple[bool, str, str, dict, list[int], int]]]:
    """The files in about as many tasks as slots, or TASK_BYTES each, whichever is more, by size."""
    total = sum(f[5] for f in files)
    count = min(len(files), max(slots, -(-total // TASK_BYTES)))
    tasks: list[list] = [[] for _ in range(count)]
    load = [0] * count
    for quarantine, root, path, values, deleted, size, index in sorted(files, key=lambda f: -f[5]):
        lightest = load.index(min(load))
        tasks[lightest].append((quarantine, root, path, values, deleted, index))
        load[lightest] += size
    return [t for t in tasks if t]
