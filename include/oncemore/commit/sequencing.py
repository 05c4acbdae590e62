"""An upsert table's record of the ``upsert.sequence_by`` its sequences were computed with (the
table property SEQUENCE_PROPERTY; "": none, Kafka's offsets): recorded by the first run, checked
before every run writes a file and again on the snapshot each MERGE commits on.

Invariant: no commit compares sequences of two expressions. A pipeline whose expression differs
from the table's is refused, naming both, until ``oncemore resequence`` (ops/resequence.py)
accepts the change; a table made before the record counts as ordered by a sequence when it has a
``_sequence`` column (its expression is then taken to be the pipeline's).
"""

from __future__ import annotations

from typing import Mapping

import pyarrow as pa
from deltalake import DeltaTable

from oncemore.core.columns import SEQUENCE_COLUMN, SEQUENCE_PROPERTY
from oncemore.core.errors import OncemoreError
from oncemore.core.storage import table_location
from oncemore.plan.ledger import open_table


class SequenceChanged(OncemoreError):
    """The table's sequences were computed with another upsert.sequence_by than the pipeline's."""


def check_sequence(pipeline: str, table_uri: str, table: DeltaTable | None, sequence_by: str | None) -> None:
    """SequenceChanged unless ``table`` (None: none yet) was ordered by ``sequence_by``: its
    SEQUENCE_PROPERTY, or for a table older than it, whether it has a sequence column."""
    if table is None:
        return
    wanted = sequence_by or ""
    recorded = table.metadata().configuration.get(SEQUENCE_PROPERTY)
    if recorded is None:  # a table made before the expression was recorded
        had = SEQUENCE_COLUMN in pa.schema(table.schema().to_arrow()).names
        if had == bool(wanted):
            return
        recorded_text = "a sequence_by (a _sequence column)" if had else "no sequence_by (Kafka's offsets)"
    elif recorded == wanted:
        return
    else:
        recorded_text = f"sequence_by {recorded!r}" if recorded else "no sequence_by (Kafka's offsets)"
    wanted_text = f"sequence_by {wanted!r}" if wanted else "no sequence_by"
    raise SequenceChanged(
        f"pipeline {pipeline}: table {table_uri} was ordered by {recorded_text}, the pipeline says {wanted_text}: "
        "the rows and deletes it holds would be compared with sequences of another meaning; nothing was "
        "committed. `oncemore resequence` accepts the change (the rows held then lose to any later event)",
        pipeline=pipeline, table_uri=table_uri, recorded=recorded, sequence_by=wanted)



def record_sequence(table_uri: str, sequence_by: str | None, storage_options: Mapping[str, str] | None) -> None:
    """Records ``sequence_by`` ("": none) in the upsert table's properties where it is not yet
    (a new table, or one made before it was recorded, checked by merge.check_sequence first)."""
    table = open_table(table_location(table_uri), storage_options)
    if table.metadata().configuration.get(SEQUENCE_PROPERTY) is None:
        table.alter.set_table_properties({SEQUENCE_PROPERTY: sequence_by or ""}, raise_if_not_exists=False)
