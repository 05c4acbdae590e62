"""AWS Glue's Data Catalog as registration needs it (boto3): read an entry, find the table at a
location, create a database, create or update an external Delta table.

The account, region, endpoint and credentials are AWS's standard environment and configuration
(AWS_REGION or AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, AWS_PROFILE, an instance role, ...), as for any AWS tool; none of
them passes through oncemore's config or its logs. Tables are shaped as delta-spark registers
them through Glue (catalog/entries.py), with their columns, as Glue's Delta crawler keeps them.
"""

from __future__ import annotations

import os

import boto3
from botocore.config import Config

from oncemore.catalog.entries import INPUT_FORMAT, OUTPUT_FORMAT, PROVIDER_KEY, SERDE, Entry, Registered

# Bounded waits: a catalog that does not answer costs a run a minute or so, not an hour.
CLIENT_CONFIG = Config(connect_timeout=10, read_timeout=30, retries={"mode": "standard", "max_attempts": 3})


class GlueCatalog:
    """Glue's Data Catalog of the environment's account and region; a context manager."""

    def __init__(self):
        # boto3 reads AWS_DEFAULT_REGION and profiles, not AWS_REGION, which the other AWS SDKs
        # (and delta-rs) read: either names the region.
        self._client = boto3.client("glue", region_name=os.environ.get("AWS_REGION") or None, config=CLIENT_CONFIG)

    def __enter__(self) -> "GlueCatalog":
        return self

    def __exit__(self, *_exc) -> None:
        self._client.close()

    def create_database(self, database: str) -> None:
        try:
            self._client.create_database(DatabaseInput={"Name": database, "Description": "created by oncemore"})
        except self._client.exceptions.AlreadyExistsException:
            pass

    def get(self, database: str, name: str) -> Registered | None:
        try:
            table = self._client.get_table(DatabaseName=database, Name=name)["Table"]
        except self._client.exceptions.EntityNotFoundException:  # no such table, or no such database
            return None
        sd = table.get("StorageDescriptor", {})
        return Registered(location=sd.get("Location"), columns=tuple((c["Name"], c["Type"]) for c in sd.get("Columns", [])),
                          provider=table.get("Parameters", {}).get(PROVIDER_KEY))

    def name_at(self, database: str, location: str, same) -> str | None:
        """The name of a table of ``database`` registered at ``location`` (``same`` compares two
        locations), or None."""
        try:
            for page in self._client.get_paginator("get_tables").paginate(DatabaseName=database):
                for table in page["TableList"]:
                    if same(table.get("StorageDescriptor", {}).get("Location"), location):
                        return table["Name"]
        except self._client.exceptions.EntityNotFoundException:
            return None
        return None

    def create(self, entry: Entry, pipeline: str) -> bool:
        """Registers ``entry``; False when a table of that name appeared meanwhile (another run's)."""
        try:
            self._client.create_table(DatabaseName=entry.database, TableInput=_table_input(entry, pipeline))
            return True
        except self._client.exceptions.AlreadyExistsException:
            return False

    def update(self, entry: Entry, pipeline: str) -> None:
        """Brings the registered table's columns and parameters to ``entry``'s, keeping others' parameters."""
        current = self._client.get_table(DatabaseName=entry.database, Name=entry.name)["Table"]
        wanted = _table_input(entry, pipeline)
        wanted["Parameters"] = {**current.get("Parameters", {}), **wanted["Parameters"]}
        self._client.update_table(DatabaseName=entry.database, TableInput=wanted)


def _table_input(entry: Entry, pipeline: str) -> dict:
    return {
        "Name": entry.name, "TableType": "EXTERNAL_TABLE", "Parameters": entry.parameters(pipeline),
        "StorageDescriptor": {
            "Columns": [{"Name": name, "Type": kind} for name, kind in entry.columns],
            "Location": entry.location, "InputFormat": INPUT_FORMAT, "OutputFormat": OUTPUT_FORMAT,
            "SerdeInfo": {"SerializationLibrary": SERDE, "Parameters": {"path": entry.location,
                                                                        "serialization.format": "1"}},
        },
    }
