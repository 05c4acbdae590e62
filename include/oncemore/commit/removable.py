"""Which of a table's files delta-rs can remove. delta-rs writes a remove action's path escaped its
own way (every byte outside DELTA_RS_PATH_SAFE percent-encoded), and readers (delta-rs and
delta-spark alike) pair a remove with its add by the path as the log stores it. A file whose add
another writer spelled otherwise (delta-spark leaves a partition value's ``é`` raw where delta-rs
writes ``%C3%A9``: delta-kernel-rs issue 2423) stays live beside whatever rewrote it, its rows
twice: delta-rs's own MERGE, compaction and delete do that, and report success.

Invariant: no operation of oncemore that removes files through delta-rs (the local MERGE, the
cluster's copy-on-write, compaction, ``delete``, ``resequence``) runs where it would remove such a
file: it is refused first (UnremovableFile), naming the file and WAY_OUT.
"""

from __future__ import annotations

from typing import Mapping
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from oncemore.core.errors import OncemoreError
from oncemore.core.storage import filesystem
from oncemore.write.files import logged_partition_values
from oncemore.write.rewrite import column_batches

# What delta-rs (1.6) leaves unescaped in a remove action's path; it escapes every other
# character, a '%' included, of the path it is given (checked by test_merge).
DELTA_RS_PATH_SAFE = "/!$&'()+,:;=@"

SPELLED = "the log spells its path otherwise than delta-rs writes a remove (another writer added it)"

# Checked against delta-spark 4.4: its OPTIMIZE removes a file by the path its log stores, and
# with random prefixes its new file's path is ASCII, which delta-rs spells as stored.
WAY_OUT = ("have delta-spark rewrite it under an ASCII path (ALTER TABLE ... SET TBLPROPERTIES "
           "('delta.randomizeFilePrefixes' = 'true'), then OPTIMIZE ... WHERE <its partition> ZORDER BY "
           "(<a column>); docs/upserts.md)")


class UnremovableFile(OncemoreError):
    """A file an operation would remove is stored in the log otherwise than delta-rs writes a remove
    action's path (another writer spelled it): its remove would not cancel its add, keeping both its
    rows and their rewrite."""


def delta_rs_spelling(stored: str) -> str:
    """The path delta-rs writes in a remove of the file whose add stores ``stored``."""
    return quote(unquote(stored), safe=DELTA_RS_PATH_SAFE)


def unremovable(table: DeltaTable) -> list[dict]:
    """The live files (their add actions) delta-rs cannot remove: stored otherwise than it spells them."""
    adds = pa.table(table.get_add_actions(flatten=False)).to_pylist()
    return [add for add in adds if delta_rs_spelling(add["path"]) != add["path"]]


def holding(table: DeltaTable, files: list[dict], columns: list[str], probe: pa.Table,
            storage_options: Mapping[str, str] | None = None) -> list[dict]:
    """Those of ``files`` (add actions of ``table``) holding a row whose ``columns`` equal a row of
    ``probe``, each file read as the cluster's rewrite reads it (its ``columns`` only)."""
    if not files or not probe.num_rows:
        return []
    partition_columns = list(table.metadata().partition_columns)
    schema = pa.schema(table.schema().to_arrow())
    probe = pa.table(probe).select(columns).cast(pa.schema([schema.field(c) for c in columns]))
    fs, root = filesystem(table.table_uri, storage_options)
    found = []
    for add in files:
        values = logged_partition_values(add, partition_columns)
        if any(batch.join(probe, columns, join_type="inner").num_rows
               for batch in column_batches(pq.ParquetFile(fs.open_input_file(f"{root}/{unquote(add['path'])}")),
                                           tuple(columns), values, schema)):
            found.append(add)
    return found
