"""Table locations: what delta-rs is given, and the pyarrow filesystem executors write files with.

Local paths are made absolute so every process (driver, executors, Airflow tasks) agrees on them.
Object stores take delta-rs's storage option keys (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ...); the
executors' pyarrow filesystem is built from the same keys, so both write to the same place with
the same credentials. Tested on S3 (moto's server); ``gs://`` and ``abfss://`` go through
pyarrow's and delta-rs's own URI handling, untested here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping
from urllib.parse import urlsplit

import pyarrow.fs as pafs


def table_location(table_uri: str) -> str:
    """The URI delta-rs is given: local paths made absolute."""
    return table_uri if "://" in table_uri else str(Path(table_uri).expanduser().resolve())


def table_key(table_uri: str) -> str:
    """One text per table however its URI is spelt (``/d/t``, ``/d/./t/`` and ``/x/../d/t`` alike)."""
    return table_location(table_uri).rstrip("/")


def same_table(first: str, second: str) -> bool:
    return table_key(first) == table_key(second)


def filesystem(table_uri: str, storage_options: Mapping[str, str] | None = None) -> tuple[pafs.FileSystem, str]:
    """pyarrow filesystem and root path of a table URI."""
    if "://" not in table_uri:
        return pafs.LocalFileSystem(), table_location(table_uri)
    parts = urlsplit(table_uri)
    if parts.scheme in ("s3", "s3a"):
        return _s3(storage_options or {}), f"{parts.netloc}{parts.path}".rstrip("/")
    fs, path = pafs.FileSystem.from_uri(table_uri)
    return fs, path.rstrip("/")


def location_problem(table_uri: str, storage_options: Mapping[str, str] | None = None) -> str | None:
    """Why no table can be created at ``table_uri``, found without writing; None when nothing
    says so. Locally: the location or its nearest existing parent must be a directory this user
    may write. On S3: the bucket must not be missing (a user may write a prefix without the right
    to look at the bucket, so an error asking says nothing; whether the store takes this user's
    writes shows only by writing). Other stores are not asked: pyarrow would ignore the
    pipeline's storage options there and try the machine's ambient credentials."""
    if "://" in table_uri and urlsplit(table_uri).scheme not in ("s3", "s3a"):
        return None
    fs, path = filesystem(table_uri, storage_options)
    if isinstance(fs, pafs.LocalFileSystem):
        existing = Path(path)
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            return f"{existing} is a file, not a directory"
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"{existing} is not writable by this user"
        return None
    bucket = path.split("/", 1)[0]
    try:
        missing = fs.get_file_info(bucket).type == pafs.FileType.NotFound
    except OSError:
        return None
    return f"bucket {bucket} does not exist" if missing else None


def _s3(options: Mapping[str, str]) -> pafs.S3FileSystem:
    """pyarrow's S3 filesystem from delta-rs's option keys (either case); unset ones fall back to
    AWS's own chain (environment, profile, instance role), as they do for delta-rs."""
    option = {k.upper(): v for k, v in options.items()}.get
    endpoint = option("AWS_ENDPOINT_URL") or option("AWS_ENDPOINT")
    settings = {
        "access_key": option("AWS_ACCESS_KEY_ID"), "secret_key": option("AWS_SECRET_ACCESS_KEY"),
        "session_token": option("AWS_SESSION_TOKEN"), "region": option("AWS_REGION") or option("AWS_DEFAULT_REGION"),
    }
    if endpoint:
        scheme, _, host = endpoint.rpartition("://")
        settings.update(endpoint_override=host or endpoint, scheme=scheme or "https")
    return pafs.S3FileSystem(**{k: v for k, v in settings.items() if v})
