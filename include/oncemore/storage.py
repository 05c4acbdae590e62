"""Table locations: what delta-rs is given, and the pyarrow filesystem executors write files with.

Local paths are made absolute so every process (driver, executors, Airflow tasks) agrees on them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pyarrow.fs as pafs


def table_location(table_uri: str) -> str:
    """The URI delta-rs is given: local paths made absolute."""
    return table_uri if "://" in table_uri else str(Path(table_uri).expanduser().resolve())


def filesystem(table_uri: str, storage_options: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem and root path of a table URI."""
    if "://" not in table_uri:
        return pafs.LocalFileSystem(), table_location(table_uri)
    fs, path = pafs.FileSystem.from_uri(table_uri)
    return fs, path.rstrip("/")
