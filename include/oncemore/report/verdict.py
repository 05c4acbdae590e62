"""A verification's verdict (``oncemore verify``): what was audited, the rows counted, and each
discrepancy by kind with the first few named; kept beside the main table's log (a routed
pipeline's: the quarantine table's) as the pipeline's last result, for the oncemore page and ``status``.

Invariant: a verdict is OK only when no discrepancy of any kind was found; reading the last one
needs no Spark.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from oncemore.config.model import Pipeline
from oncemore.config.values import format_timestamp_ms
from oncemore.core.storage import filesystem
from oncemore.plan.tables import plan_table_uri

EXAMPLES = 5  # discrepancies named per kind
# The last recorded result, for the oncemore page: beside the main table's log, in a directory
# Delta readers and vacuum ignore (its name starts with "_").
RESULT_PATH = "_oncemore/verify.json"


@dataclass(frozen=True)
class Discrepancy:
    kind: str  # history | position | outside | duplicate | count; an upsert table's: key | replay
    topic: str
    partition: int
    start: int
    end: int
    versions: tuple[int, ...]
    detail: str
    table: str | None = None  # a routed pipeline's: the route (or "quarantine") whose table it is about

    def line(self) -> str:
        versions = f" (version {', '.join(map(str, self.versions))})" if self.versions else ""
        table = f" in table {self.table}" if self.table else ""
        return f"{self.kind}{table}: {self.topic}/{self.partition} [{self.start}, {self.end}){versions}: {self.detail}"


@dataclass
class VerifyReport:
    pipeline: str
    table_version: int
    quarantine_version: int | None
    commits: int  # the pipeline's commits whose counts are audited
    since: int | None  # counts audited from this version on (None: every kept commit)
    whole_log: bool  # the log keeps every commit since the table's first
    rows: dict[str, int] = field(default_factory=dict)  # main, quarantine, pending, before, foreign, deleted
    offsets_without_row: int = 0  # in committed ranges: filtered, transaction markers, aborted
    filtered: int = 0  # of which the records say a transform filtered
    discrepancies: list[Discrepancy] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # discrepancies per kind (more than listed)
    # An upsert table's: the audited commits' events by what they did (commit/merge.py's counts),
    # and with a replay, the records it read, its keys by how they compare (same, different,
    # missing, extra, deleted_since, unreplayed) and the records compaction removed since.
    events: dict[str, int] | None = None
    replayed: dict[str, int] | None = None
    # A routed pipeline's: by route (and "quarantine"), its table, version, audited commits and rows;
    # and the records its quarantine table's commits count as unrouted and skipped.
    tables: dict[str, dict] | None = None
    unrouted: int = 0

    @property
    def ok(self) -> bool:
        return not self.counts

    def add(self, found: Discrepancy) -> None:
        self.counts[found.kind] = self.counts.get(found.kind, 0) + 1
        if sum(d.kind == found.kind for d in self.discrepancies) < EXAMPLES:
            self.discrepancies.append(found)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)

    def describe(self) -> str:
        audited = ("every commit of the log" if self.whole_log else "the commits the log keeps") + (
            f"; counts from version {self.since} on" if self.since is not None else "")
        lines = [f"{self.pipeline}: {'OK' if self.ok else 'FAILED'}: {self.commits} commits audited ({audited}), "
                 f"table version {self.table_version}, quarantine version {self.quarantine_version}",
                 f"  rows: {self.rows.get('main', 0)} in the table, {self.rows.get('quarantine', 0)} quarantined, "
                 f"{self.rows.get('pending', 0)} quarantined for a batch still to commit, "
                 f"{self.rows.get('before', 0)} before the pipeline's kept history, "
                 f"{self.rows.get('deleted', 0)} deleted since by oncemore delete"]
        if self.tables is not None:
            lines[0] = (f"{self.pipeline}: {'OK' if self.ok else 'FAILED'}: {self.commits} commits audited ({audited}) "
                        "across its route tables and quarantine table")
            lines[1] = "  rows: " + ", ".join(f"{t['rows']} in {'the quarantine' if name == 'quarantine' else 'route '+ name}"
                                              f" (version {t['version']})" for name, t in self.tables.items()) + (
                f", {self.rows.get('before', 0)} before the kept history, {self.rows.get('deleted', 0)} deleted since "
                "by oncemore delete")
            lines.append(f"  offsets of the quarantine table's committed ranges in no table: {self.offsets_without_row}"
                         f" ({self.unrouted} more counted as unrouted and skipped; the rest transaction markers, aborted "
                         "records, records compaction removed, or a route table's still to commit)")
        elif self.events is None:
            lines.append(f"  offsets of committed ranges without a row: {self.offsets_without_row} "
                         f"({self.filtered} filtered by the transform, the rest transaction markers, aborted records "
                         "or records compaction removed)")
        else:
            lines.append("  events: " + ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in self.events.items())
                         + f"; offsets of committed ranges without a record: {self.offsets_without_row} (transaction "
                           "markers, aborted records or records compaction removed)")
        if self.replayed is not None:
            lines.append("  replay: " + ", ".join(f"{n} {what}" for what, n in self.replayed.items()))
        for kind, count in sorted(self.counts.items()):
            lines.append(f"  {count} {kind} discrepanc{'y' if count == 1 else 'ies'}:")
            lines += [f"    {d.line()}" for d in self.discrepancies if d.kind == kind]
        return "\n".join(lines)


def record_result(pipeline: Pipeline, report: VerifyReport) -> None:
    """Keeps ``report`` as the pipeline's last verification (``last_result``), stamped now."""
    fs, root = filesystem(plan_table_uri(pipeline), pipeline.sink.storage_options)
    fs.create_dir(f"{root}/{RESULT_PATH.rsplit('/', 1)[0]}", recursive=True)
    with fs.open_output_stream(f"{root}/{RESULT_PATH}") as out:
        out.write(json.dumps({**json.loads(report.to_json()), "at": format_timestamp_ms(int(time.time() * 1000)),
                              "summary": report.describe().splitlines()[0]}).encode())


def last_result(pipeline: Pipeline) -> dict | None:
    """The pipeline's last recorded verification (None: never recorded)."""
    fs, root = filesystem(plan_table_uri(pipeline), pipeline.sink.storage_options)
    try:
        with fs.open_input_stream(f"{root}/{RESULT_PATH}") as source:
            return json.loads(source.read())
    except FileNotFoundError:
        return None
