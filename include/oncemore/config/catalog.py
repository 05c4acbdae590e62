"""The ``sink.catalog`` block of a pipeline file: the catalog the pipeline's tables are registered
in (catalog/registration.py), and under which names.

Its shape is a contract (tools outside the project write it): ``{type: hive, uri: thrift://host:port,
database, table}`` or ``{type: glue, database, table}``. Glue's endpoint, region and credentials
are AWS's standard environment (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, ...), never the file.
The quarantine table is registered as ``<table>_quarantine``, an upsert's tombstones table as
``<table>_tombstones``, a routed pipeline's table of route ``<value>`` as ``<table>_<value>``, in the
same database.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, StrictStr, Tag

from oncemore.config.values import ConfigModel

# The suffixes of the other tables' names (catalog/registration.py names them).
QUARANTINE_SUFFIX, TOMBSTONES_SUFFIX = "_quarantine", "_tombstones"
# Hive and Glue both keep names in lower case (Hive lowercases what it is given; Glue's console and
# Athena expect it) and allow 128 characters; the longest suffix must still fit.
CatalogName = Annotated[StrictStr, Field(pattern=r"^[a-z_][a-z0-9_]{0,116}$",
                                         description="lowercase letters, digits and _ (at most 117 characters)")]


class _Catalog(ConfigModel):
    database: CatalogName = Field(description="created when missing")
    table: CatalogName = Field(description="the main table's name; the quarantine table is <table>_quarantine, an "
                                           "upsert's tombstones table <table>_tombstones, a route's <table>_<route>")


class HiveCatalog(_Catalog):
    """A Hive Metastore, over its Thrift API (unsecured: no SASL or Kerberos)."""

    type: Literal["hive"]
    uri: StrictStr = Field(pattern=r"^thrift://[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$",
                           description="the metastore's Thrift address, thrift://host:port")

    def describe(self) -> str:
        """The catalog as a line names it (no credential is part of it)."""
        return f"hive {self.uri}"


class GlueCatalog(_Catalog):
    """AWS Glue's Data Catalog of the account and region the AWS environment names."""

    type: Literal["glue"]

    def describe(self) -> str:
        """The catalog as a line names it."""
        return "glue"


CATALOGS = {"hive": HiveCatalog, "glue": GlueCatalog}
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,127}$")


def catalog_name(table: str, route: str | None) -> str:
    """The catalog name of a pipeline's table: ``table``, or for a route's, ``<table>_<route>``."""
    return table if route is None else f"{table}_{route}"


def route_name_problem(table: str, route: str) -> str | None:
    """Why route ``route``'s table cannot be registered under ``<table>_<route>``, or None."""
    name = catalog_name(table, route)
    if not _NAME.match(name):
        return (f"the table of route {route!r} would be registered as {name!r}, which is not a catalog name "
                "(lowercase letters, digits and _, at most 128 characters)")
    if route in (QUARANTINE_SUFFIX[1:], TOMBSTONES_SUFFIX[1:]):
        return f"the table of route {route!r} would be registered as {name!r}, the quarantine table's name"
    return None


def _catalog_kind(value: Any) -> str | None:
    """The model a ``catalog`` block is, by its ``type`` (tagged by the model's name, so that an
    error names the block's keys, not the tag: loading._problem drops model names)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return CATALOGS[kind].__name__ if kind in CATALOGS else None


Catalog = Annotated[
    Union[Annotated[HiveCatalog, Tag(HiveCatalog.__name__)], Annotated[GlueCatalog, Tag(GlueCatalog.__name__)]],
    Discriminator(_catalog_kind, custom_error_type="catalog_kind",
                  custom_error_message="needs a type: hive or glue"),
]
