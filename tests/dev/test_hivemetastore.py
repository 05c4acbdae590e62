"""The Hive Metastore the catalog tests register tables in (devtools.hivemetastore): it answers its
Thrift API, keeps what it is told across a restart on the same data directory, and leaves no JVM
behind."""

from __future__ import annotations

from pymetastore.hive_metastore import ThriftHiveMetastore
from pymetastore.hive_metastore.ttypes import Database, NoSuchObjectException
from thrift.protocol.TBinaryProtocol import TBinaryProtocol
from thrift.transport import TSocket, TTransport

from devtools.hivemetastore import start_metastore


def connect(port: int):
    transport = TTransport.TBufferedTransport(TSocket.TSocket("127.0.0.1", port))
    transport.open()
    return transport, ThriftHiveMetastore.Client(TBinaryProtocol(transport))


def test_the_metastore_answers_and_keeps_a_database_across_a_restart(tmp_path):
    metastore = start_metastore(data_dir=tmp_path)
    try:
        transport, client = connect(metastore.port)
        assert "default" in client.get_all_databases()
        try:
            client.get_database("bronze")
            raise AssertionError("a fresh metastore holds no database bronze")
        except NoSuchObjectException:
            pass
        client.create_database(Database(name="bronze", description="", locationUri=f"file:{tmp_path}/bronze",
                                        parameters={}))
        transport.close()
    finally:
        metastore.stop()
    assert metastore.process.poll() is not None

    again = start_metastore(port=metastore.port, data_dir=tmp_path)
    try:
        transport, client = connect(again.port)
        assert client.get_database("bronze").locationUri == f"file:{tmp_path}/bronze"
        transport.close()
    finally:
        again.stop()
    assert tmp_path.exists()  # a data directory of the caller's stays
