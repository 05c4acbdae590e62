"""Test-only fault injection: a run dies (SIGKILL, no clean-up) exactly when it reaches a named
step, so tests can prove what a crash there leaves behind and that a rerun ends exact.

Inert unless the environment variable ONCEMORE_FAULTS names steps (comma-separated); nothing in
a pipeline's config or on a command line can set it. The steps of a run, in order:

- ``planned``: the run's process, its plan made, before Spark starts.
- ``task``: a Spark task's Python worker, as it starts reading its ranges. Only that worker dies:
  a task failure, which fails the run (the others kill the whole run).
- ``written``: where a part's commits are made (the run's process), its files written and none
  validated yet.
- ``validated``: there, its files validated, before the quarantine commit.
- ``quarantine_committed``: there, the quarantine commit made, before the main commit (with
  routes: before the route tables' commits; commit/routed.py).
- ``route_committed``: there, a route table's commit made, before the next route table's (or,
  after the last, the outcome reaching the run).
- ``rewritten``: the run's process, an upsert part whose MERGE runs on the cluster
  (commit/copyonwrite.py): the touched files rewritten by the cluster's tasks, before the
  tombstones and main commits.
- ``tombstones_committed``: there, an upsert part's deletes kept in its tombstones table
  (commit/merge.py), before the main MERGE.
- ``main_committed``: there, the main commit made, before the outcome reaches the run.
- ``mirrored``: the run's process, a batch's positions mirrored to the consumer group.

and of ``oncemore maintain``, per table: ``compacted`` (compaction committed) and
``checkpointed`` (checkpoint written, before vacuum).

A step kills the whole run at once, as a lost machine would: the process reaching it and the
run's process group, which ``arm()`` records in ONCEMORE_FAULTS_GROUP at the start of the run's
own process (the CLI, an Airflow ingest task) when it leads its group: Spark's JVM and its Python
workers, started after, inherit the variable (pyspark's worker daemon moves them to a group of its
own). Tests start a run as its own process group (``start_new_session``); Airflow's supervisor
starts each task as one. A run in no group of its own (inside pytest) kills only the process
reaching the step, and the group is killed only when its leader is that process or one of its
ancestors: a variable inherited from elsewhere never kills another process tree.

With ONCEMORE_FAULTS_ONCE naming a directory, each step kills once (a file there marks it done),
so a retry of the same environment gets past it.
"""

from __future__ import annotations

import os
import signal
from contextlib import suppress
from pathlib import Path

FAULTS_ENV = "ONCEMORE_FAULTS"
GROUP_ENV = "ONCEMORE_FAULTS_GROUP"
ONCE_ENV = "ONCEMORE_FAULTS_ONCE"
STEPS = ("planned", "task", "written", "validated", "quarantine_committed", "route_committed", "tombstones_committed",
         "rewritten", "main_committed", "mirrored", "compacted", "checkpointed")


def arm() -> None:
    """Records the calling process's group as the run's (module docstring), when faults are set and
    it leads its group; call it first thing in a run's own process, before Spark starts."""
    if os.environ.get(FAULTS_ENV) and os.getpgrp() == os.getpid():
        os.environ[GROUP_ENV] = str(os.getpid())


def reach(step: str) -> None:
    """Dies here when ONCEMORE_FAULTS names ``step`` (module docstring)."""
    assert step in STEPS, step
    if step not in os.environ.get(FAULTS_ENV, "").split(","):
        return
    once = os.environ.get(ONCE_ENV)
    if once:
        try:
            (Path(once) / step).touch(exist_ok=False)
        except FileExistsError:
            return
    group = int(os.environ.get(GROUP_ENV) or 0)
    # Only the group a process of this run leads: never one an inherited variable names elsewhere.
    if step != "task" and group in _lineage():
        with suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _lineage() -> list[int]:
    """This process, its parent, its parent's parent, ... (Linux's /proc; only itself without it)."""
    found, pid = [os.getpid()], os.getppid()
    while pid > 1 and pid not in found:
        found.append(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found
