"""Why a run refuses to go on: typed errors whose message is one line naming the pipeline, the
topic, the partition and the offsets, and whose ``evidence`` carries the same facts for programs.

Each is raised before the run could lose, duplicate or silently skip a record; none is retried
away by oncemore itself.
"""

from __future__ import annotations

import re
from typing import Any


class OncemoreError(RuntimeError):
    """A run cannot honour its contract."""

    def __init__(self, message: str, **evidence: Any):
        super().__init__(message)
        self.evidence = evidence


class PlanError(OncemoreError):
    """The log and the ledger disagree in a way that must not be resolved silently."""


class DataLoss(PlanError):
    """Offsets the pipeline has not ingested are no longer in the log (fail_on_data_loss: true)."""


class TopicChanged(PlanError):
    """The topic the positions refer to is gone: recreated (new topic ID), another cluster, or a
    position beyond the log end."""


class PositionsMissing(PlanError):
    """The table holds data or oncemore commits but no positions for this pipeline and topic."""


class TableOwned(PlanError):
    """Another pipeline ingests the topic into the same table: a second one would duplicate every record."""


class BoundStalled(PlanError):
    """A timestamp bound cannot move past a record stamped after it while older records wait behind it."""


class JudgingChanged(PlanError):
    """What decides a table's rows from the quarantined records (its format, the key's, the
    transform, expectations, partition columns, upsert) changed while a part's quarantine commit
    landed and its main commit did not: the rerun would judge those records again."""


class RoutesChanged(PlanError):
    """A routed pipeline's routes differ from the ones its last run committed under while a table of
    those is behind: its records would be routed again by the new routes."""


class StalePlan(PlanError):
    """A handed plan does not fit the pipeline or the table's current positions."""


class CommitConflict(OncemoreError):
    """Positions moved while a batch was being written, in a way no retry of this batch can fix."""


class QuarantineExceeded(OncemoreError):
    """A part of a batch quarantined more of its records than the pipeline's ``quarantine`` limit
    allows: nothing of it was committed, its records stay in Kafka (commit/share.py)."""


class CommitNotFound(OncemoreError):
    """A commit that delta-rs reported done is not in the log after it (never a reason to delete its files)."""


class TaskFailed(OncemoreError):
    """A Spark task of a run failed (or its Python worker died); names the ranges it was reading."""


class SparkConnectError(OncemoreError):
    """No session on a Spark Connect server; names the server by host and port only (its URL may carry a token)."""


class InvalidDataFile(OncemoreError):
    """A written file is not what the commit may reference (missing, wrong schema, offsets outside its range)."""


class KafkaAccessDenied(OncemoreError):
    """Kafka's authorizer refuses the pipeline's principal a right a run needs; the message names
    the topic or group and the right (evidence: ``resource``, ``name``, ``operation``)."""


class KafkaClientFileError(OncemoreError):
    """A Kafka client cannot be made from the pipeline's settings: a certificate, key or CA file
    that cannot be opened or loaded (evidence: ``option``, ``path``)."""


class TableLocationError(OncemoreError):
    """No table can be created where the pipeline's config puts one."""


class UnsupportedTable(OncemoreError):
    """An existing table asks writers for work oncemore does not do (constraints, features)."""


class CatalogError(OncemoreError):
    """The catalog of ``sink.catalog`` did not take the tables' registration (or did not answer).
    Raised after the commits: the data is in the tables, and the next run registers them again."""


class MirrorError(OncemoreError):
    """The consumer-group mirror (``commit_consumer_group``) did not take a commit's positions.
    Raised after the commits: the table holds the positions, and the next run mirrors them."""


class CatalogConflict(CatalogError):
    """The catalog holds the name at another location, or the location under another name: oncemore
    re-points or renames nothing it did not register itself."""


def interrupted_by(exc: BaseException) -> bool:
    """Whether ``exc`` is a Ctrl-C, or was raised while one unwound (its cause or context holds it)."""
    chain, seen = [exc], set()
    while chain:
        link = chain.pop()
        if isinstance(link, KeyboardInterrupt):
            return True
        if link is not None and id(link) not in seen:
            seen.add(id(link))
            chain += [link.__cause__, link.__context__]
    return False


def root_cause(exc: BaseException) -> str:
    """One line for an exception, digging the cause out of a Spark job failure: the Python error
    a task raised, else why its Python worker could not start, else the failure Spark reports for
    the lost task (a Python worker that died)."""
    text = str(exc)
    # The last line of a Python traceback: a builtin's name, or a qualified one
    # (oncemore.run.deltasink.ExpectationFailed), not the JVM's (org.apache.spark.SparkException) that wraps it.
    found = [(name.rpartition(".")[2], message) for name, message in
             re.findall(r"^\s*((?:[a-z_]\w*\.)+[A-Z]\w*|\w+(?:Error|Exception|Conflict)): (.+)$", text, re.M)
             if not name.startswith(("org.", "java.", "scala.", "py4j."))]
    if found:
        name, message = found[-1]
        return f"{name}: {message.strip()}"
    # A Python worker (or its daemon: spark.python.daemon.module) that could not start: Spark quotes its stderr.
    unstarted = re.search(r"^Error from python worker:\n(.*?)\nPYTHONPATH was:", text, re.M | re.S)
    if unstarted and unstarted.group(1).strip():
        return f"Python worker failed to start: {unstarted.group(1).strip().splitlines()[-1].strip()}"
    lost = re.search(r"Lost task [^\n]*?\): (?:[\w.]+\.)?(\w+): ([^\n]+?)(?:\. Consider [^\n]*)?$", text, re.M)
    if lost:
        return f"{lost.group(1)}: {lost.group(2).strip()}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}"
