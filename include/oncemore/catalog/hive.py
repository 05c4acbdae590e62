"""A Hive Metastore as registration needs it, over its Thrift API: read an entry, find the table at a
location, create a database, create or update an external Delta table.

It uses the client pymetastore generates from Hive's Thrift definition, and only calls both Hive 3
and Hive 4 metastores serve (Hive 4 dropped ``get_table``; ``get_table_req`` is in both). Tables
are created and altered with ``DO_NOT_UPDATE_STATS``: otherwise the metastore lists the table's
directory on every change to count its files, which for a Delta table are not its rows, and which
it may not even be able to reach. Unsecured metastores only (no SASL or Kerberos).
"""

from __future__ import annotations

import getpass
import time
from urllib.parse import urlsplit

from pymetastore.hive_metastore import ThriftHiveMetastore
from pymetastore.hive_metastore.ttypes import (
    AlreadyExistsException,
    Database,
    EnvironmentContext,
    FieldSchema,
    GetTableRequest,
    GetTablesRequest,
    NoSuchObjectException,
    SerDeInfo,
    StorageDescriptor,
    Table,
)
from thrift.protocol.TBinaryProtocol import TBinaryProtocol
from thrift.transport import TSocket, TTransport

from oncemore.catalog.entries import INPUT_FORMAT, OUTPUT_FORMAT, PROVIDER_KEY, SERDE, Entry, Registered

# A metastore that accepts a connection and then says nothing must not hold a run for long.
TIMEOUT_MS = 30_000
NO_STATISTICS = EnvironmentContext(properties={"DO_NOT_UPDATE_STATS": "true"})
TABLES_PER_REQUEST = 100  # tables fetched per get_table_objects_by_name_req while looking for a location


class HiveMetastore:
    """A connection to the metastore at ``uri`` (thrift://host:port); a context manager."""

    def __init__(self, uri: str):
        parts = urlsplit(uri)
        socket = TSocket.TSocket(parts.hostname, parts.port)
        socket.setTimeout(TIMEOUT_MS)
        self._transport = TTransport.TBufferedTransport(socket)
        self._client = ThriftHiveMetastore.Client(TBinaryProtocol(self._transport))

    def __enter__(self) -> "HiveMetastore":
        self._transport.open()
        return self

    def __exit__(self, *_exc) -> None:
        self._transport.close()

    def create_database(self, database: str) -> None:
        """The database, in the metastore's warehouse (another run may have created it meanwhile)."""
        try:
            self._client.create_database(Database(name=database, description="created by oncemore", parameters={}))
        except AlreadyExistsException:
            pass

    def get(self, database: str, name: str) -> Registered | None:
        try:
            table = self._client.get_table_req(GetTableRequest(dbName=database, tblName=name)).table
        except NoSuchObjectException:  # no such table, or no such database
            return None
        return _registered(table)

    def name_at(self, database: str, location: str, same) -> str | None:
        """The name of a table of ``database`` registered at ``location`` (``same`` compares two
        locations), or None."""
        try:
            names = self._client.get_all_tables(database)
        except NoSuchObjectException:
            return None
        for start in range(0, len(names), TABLES_PER_REQUEST):
            request = GetTablesRequest(dbName=database, tblNames=names[start:start + TABLES_PER_REQUEST])
            for table in self._client.get_table_objects_by_name_req(request).tables:
                if same(table.sd.location if table.sd else None, location):
                    return table.tableName
        return None

    def create(self, entry: Entry, pipeline: str) -> bool:
        """Registers ``entry``; False when a table of that name appeared meanwhile (another run's)."""
        try:
            self._client.create_table_with_environment_context(_table(entry, pipeline), NO_STATISTICS)
            return True
        except AlreadyExistsException:
            return False

    def update(self, entry: Entry, pipeline: str) -> None:
        """Brings the registered table's columns and parameters to ``entry``'s, keeping the rest
        (its owner, creation time, others' parameters)."""
        current = self._client.get_table_req(GetTableRequest(dbName=entry.database, tblName=entry.name)).table
        wanted = _table(entry, pipeline)
        current.sd.cols = wanted.sd.cols
        current.sd.serdeInfo.parameters = {**(current.sd.serdeInfo.parameters or {}), **wanted.sd.serdeInfo.parameters}
        current.parameters = {**(current.parameters or {}), **wanted.parameters}
        self._client.alter_table_with_environment_context(entry.database, entry.name, current, NO_STATISTICS)


def _table(entry: Entry, pipeline: str) -> Table:
    return Table(
        tableName=entry.name, dbName=entry.database, owner=getpass.getuser(), createTime=int(time.time()),
        lastAccessTime=0, retention=0, partitionKeys=[], tableType="EXTERNAL_TABLE",
        parameters=entry.parameters(pipeline),
        sd=StorageDescriptor(
            cols=[FieldSchema(name=name, type=kind, comment="") for name, kind in entry.columns],
            location=entry.location, inputFormat=INPUT_FORMAT, outputFormat=OUTPUT_FORMAT, compressed=False,
            numBuckets=-1, bucketCols=[], sortCols=[], parameters={},
            serdeInfo=SerDeInfo(serializationLib=SERDE, parameters={"path": entry.location, "serialization.format": "1"})))


def _registered(table: Table) -> Registered:
    sd = table.sd
    return Registered(location=sd.location if sd else None,
                      columns=tuple((c.name, c.type) for c in (sd.cols or [])) if sd else (),
                      provider=(table.parameters or {}).get(PROVIDER_KEY))
