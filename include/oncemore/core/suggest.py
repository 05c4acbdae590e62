"""The "did you mean" of an error about a name that is not there: the known name closest to it
(a misspelt config key, a topic the cluster does not have).

Invariant: a suggestion is only ever one of the names given as known, so it never reveals more
than the caller could list (a topic the user may not describe is not among them).
"""

from __future__ import annotations

import difflib
from typing import Iterable


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name most like ``name``, if one is close enough to be a typo of it."""
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return found[0] if found else None
