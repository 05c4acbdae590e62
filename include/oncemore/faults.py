"""Test-only fault injection: a process dies (SIGKILL, no clean-up) exactly when it reaches a
named step of a run, so tests can prove what a crash there leaves behind.

Inert unless the environment variable ONCEMORE_FAULTS names steps (comma-separated); nothing in
a pipeline's config or on a command line can set it. Steps:

- ``task``: a Spark task's Python worker, as it starts reading its ranges.
- ``committed``: the Python worker of the ``oncemore_delta`` sink's driver-side commit, right after
  the part's commits landed and before it hands the outcome on.
"""

from __future__ import annotations

import os
import signal

FAULTS_ENV = "ONCEMORE_FAULTS"


def reach(step: str) -> None:
    """Dies here when ONCEMORE_FAULTS names ``step``."""
    if step in os.environ.get(FAULTS_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
