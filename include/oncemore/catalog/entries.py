"""What a pipeline's tables should be in its catalog (``sink.catalog``): one entry per Delta table
that exists (the main table or each route's, its quarantine table, an upsert's tombstones table),
named after ``sink.catalog.table``, at the table's location, with the columns of the table's
current schema.

An entry is an external Delta table as delta-spark itself registers one in a Hive Metastore (and
so in Glue, which Spark reaches through the same client): table parameter
``spark.sql.sources.provider=delta``, the location in the ``path`` SerDe parameter as well as the
storage descriptor's, and formats no Hive reader takes for Parquet (a reader that does not know
Delta fails instead of reading every file the log ever added). Unlike delta-spark, which leaves a
placeholder column, the columns are the table's, in Hive's type names, as Glue's crawler and
Athena keep them for Lake Formation and for engines that list columns from the catalog: Spark
reads the schema from the table's log whatever the catalog says.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from oncemore.config.catalog import QUARANTINE_SUFFIX, TOMBSTONES_SUFFIX, catalog_name
from oncemore.config.model import Pipeline
from oncemore.core.storage import table_location
from oncemore.plan.ledger import open_table

PROVIDER_KEY, PROVIDER = "spark.sql.sources.provider", "delta"
# The storage descriptor delta-spark (Spark's HiveExternalCatalog) gives a data source table no
# Hive SerDe can read.
INPUT_FORMAT = "org.apache.hadoop.mapred.SequenceFileInputFormat"
OUTPUT_FORMAT = "org.apache.hadoop.hive.ql.io.HiveSequenceFileOutputFormat"
SERDE = "org.apache.hadoop.hive.serde2.lazy.LazySimpleSerDe"
# Delta's primitive type names that Hive spells otherwise; the rest (string, binary, boolean,
# float, double, date, timestamp, decimal(p,s)) are the same. Hive's timestamp has no zone.
HIVE_TYPES = {"long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint", "timestamp_ntz": "timestamp"}

Columns = tuple[tuple[str, str], ...]  # (name, Hive type), in the table's order


@dataclass(frozen=True)
class Entry:
    """One table as the catalog should hold it."""

    role: str  # "table", "quarantine table" or "tombstones table"
    database: str
    name: str
    location: str  # as registered: a local table as a file: URI
    columns: Columns

    @property
    def qualified(self) -> str:
        return f"{self.database}.{self.name}"

    def parameters(self, pipeline: str) -> dict[str, str]:
        return {"EXTERNAL": "TRUE", PROVIDER_KEY: PROVIDER, "oncemore.pipeline": pipeline}


@dataclass(frozen=True)
class Registered:
    """What the catalog holds under an entry's name."""

    location: str | None
    columns: Columns
    provider: str | None

    def matches(self, entry: Entry) -> bool:
        """Whether nothing needs registering again: a Delta table there, with the entry's columns
        (names compared as the catalogs keep them, in lower case)."""
        return self.provider == PROVIDER and _normalized(self.columns) == _normalized(entry.columns)


def entries(pipeline: Pipeline) -> list[Entry]:
    """The entries of the pipeline's tables that exist, main table (or each route's) first."""
    sink, catalog = pipeline.sink, pipeline.sink.catalog
    tables = [("table" if t.route is None else f"route {t.route} table", t.table_uri, catalog_name(catalog.table, t.route))
              for t in pipeline.tables]
    tables.append(("quarantine table", sink.quarantine_uri, catalog.table + QUARANTINE_SUFFIX))
    if pipeline.upsert is not None and pipeline.upsert.sequence_by is not None:
        tables.append(("tombstones table", sink.tombstones_uri, catalog.table + TOMBSTONES_SUFFIX))
    found = []
    for role, uri, name in tables:
        table = open_table(table_location(uri), sink.storage_options)
        if table is not None:
            found.append(Entry(role, catalog.database, name, catalog_location(uri, catalog.type),
                               hive_columns(json.loads(table.schema().to_json()))))
    return found


def catalog_location(table_uri: str, kind: str) -> str:
    """The location a catalog is given for a table: a local path as a file: URI; for Glue, an
    s3a:// or s3n:// URI as s3:// (what Athena and Glue's own jobs take)."""
    if "://" not in table_uri:
        return "file:" + table_location(table_uri)
    parts = urlsplit(table_uri)
    if kind == "glue" and parts.scheme in ("s3a", "s3n"):
        return "s3" + table_uri[len(parts.scheme):]
    return table_uri


def same_location(a: str | None, b: str) -> bool:
    """Whether two registered locations are one place: file:/x, file:///x and /x are; so are an
    S3 location's s3, s3a and s3n spellings, and a trailing slash changes nothing."""
    return a is not None and _place(a) == _place(b)


def _place(location: str) -> str:
    location = location.rstrip("/")
    if location.startswith("file:"):
        return "file:/" + location[len("file:"):].lstrip("/")
    if location.startswith("/"):
        return "file:" + location
    scheme, _, rest = location.partition("://")
    return f"{'s3' if scheme in ('s3a', 's3n') else scheme}://{rest}"


def hive_columns(schema: dict[str, Any]) -> Columns:
    """The columns of a Delta schema (its JSON form) in Hive's type names."""
    return tuple((field["name"], hive_type(field["type"])) for field in schema["fields"])


def hive_type(delta_type: str | dict[str, Any]) -> str:
    """A Delta type (its JSON form) in Hive's syntax: bigint, decimal(12,2), array<string>,
    map<string,int>, struct<city:string,zip:string>."""
    if isinstance(delta_type, str):
        return HIVE_TYPES.get(delta_type, delta_type)
    kind = delta_type["type"]
    if kind == "array":
        return f"array<{hive_type(delta_type['elementType'])}>"
    if kind == "map":
        return f"map<{hive_type(delta_type['keyType'])},{hive_type(delta_type['valueType'])}>"
    return "struct<" + ",".join(f"{f['name']}:{hive_type(f['type'])}" for f in delta_type["fields"]) + ">"


def _normalized(columns: Columns) -> Columns:
    return tuple((name.lower(), kind.lower().replace(" ", "")) for name, kind in columns)
