"""The ``sink.catalog`` block of a pipeline file: the catalog the pipeline's tables are registered
in (catalog/registration.py), and under which names.

Its shape is a contract (tools outside the project write it): ``{type: hive, uri: thrift://host:port,
database, table}`` or ``{type: glue, database, table}``. Glue's endpoint, region and credentials
are AWS's standard environment (AWS_ENDPOINT_URL, AWS_REGION, AWS_PROFILE, ...), never the file.
The quarantine table is registered as ``<table>_quarantine``, an upsert's tombstones table as
``<table>_tombstones``, in the same database.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag

# The suffixes of the other tables' names (catalog/registration.py names them).
QUARANTINE_SUFFIX, TOMBSTONES_SUFFIX = "_quarantine", "_tombstones"
# Hive and Glue both keep names in lower case (Hive lowercases what it is given; Glue's console and
# Athena expect it) and allow 128 characters; the longest suffix must still fit.
CatalogName = Annotated[StrictStr, Field(pattern=r"^[a-z_][a-z0-9_]{0,116}$",
                                         description="lowercase letters, digits and _ (at most 117 characters)")]


class _Catalog(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    database: CatalogName = Field(description="created when missing")
    table: CatalogName = Field(description="the main table's name; the quarantine table is <table>_quarantine, an "
                                           "upsert's tombstones table <table>_tombstones")


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
