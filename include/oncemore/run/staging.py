"""What crosses from Spark's reading tasks back to the run when records go through Spark
DataFrames, which carry only rows: each task's RangeResult (an upsert part's change rows and its
MERGE's inputs are staged under the same directory).

They are small JSON files under the quarantine table's ``_oncemore_staging/<part>/`` (Delta
readers and vacuum ignore directories starting with ``_``), written with the tables' own storage
settings, so any process that can write the tables can hand them on: a Python worker, the run. A
task attempt writes its own file: a retried or speculative attempt of the same range leaves two,
of which exactly one is taken (the ranges are read whole and read the same records). A part's
directory is removed once the run has committed the part or failed; directories an interrupted
run left are removed by maintenance.
"""

from __future__ import annotations

import time
import uuid
from typing import Mapping

import pyarrow.fs as pafs

from oncemore.commit.inputs import STAGING_DIR
from oncemore.core.storage import filesystem


class Staging:
    """One part's staging directory."""

    def __init__(self, quarantine_uri: str, part_id: str, storage_options: Mapping[str, str] | None = None):
        self.fs, root = filesystem(quarantine_uri, storage_options)
        self.directory = f"{root}/{STAGING_DIR}/{part_id}"

    def put(self, name: str, text: str) -> None:
        self.fs.create_dir(self.directory, recursive=True)
        with self.fs.open_output_stream(f"{self.directory}/{name}.{uuid.uuid4().hex}.json") as out:
            out.write(text.encode())

    def get(self, prefix: str) -> list[str]:
        """Every text put under a name starting with ``prefix``."""
        selector = pafs.FileSelector(self.directory, allow_not_found=True)
        texts = []
        for info in self.fs.get_file_info(selector):
            if info.base_name.startswith(prefix) and info.base_name.endswith(".json"):
                with self.fs.open_input_stream(info.path) as stream:
                    texts.append(stream.read().decode())
        return texts

    def remove(self) -> None:
        try:
            self.fs.delete_dir(self.directory)
        except FileNotFoundError:
            pass


def remove_stale(quarantine_uri: str, older_than_hours: float, storage_options: Mapping[str, str] | None = None) -> int:
    """Removes part directories older than ``older_than_hours`` (runs that never took them); their count."""
    fs, root = filesystem(quarantine_uri, storage_options)
    cutoff = time.time() - older_than_hours * 3600
    removed = 0
    for info in fs.get_file_info(pafs.FileSelector(f"{root}/{STAGING_DIR}", allow_not_found=True)):
        if info.type == pafs.FileType.Directory and info.mtime is not None and info.mtime.timestamp() < cutoff:
            fs.delete_dir(info.path)
            removed += 1
    return removed
