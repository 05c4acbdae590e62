"""A Hive Metastore for the tests and local runs: Apache Hive's standalone metastore server 4.0.1,
on an embedded Derby database, from the jars scripts/setup copies for devtools/hive/pom.xml.

``start_metastore()`` runs it on a free port of 127.0.0.1 and returns once its Thrift API answers
(a call, not an open port: the server opens its port before its database is ready); ``uri`` is
what ``sink.catalog.uri`` takes. It never leaves its JVM behind: not when stopped, when it fails
to start, or when the interpreter that started it exits. Without ``data_dir`` its database lives
in a temporary directory that ``stop()`` removes.

``reader_conf(uri)``: the settings of a Spark user's session that reads tables by name through it
(PySpark's built-in Hive 2.3 client cannot: Hive 4 dropped its calls), with the Hive 4.0.1 client
scripts/setup copies for devtools/hive/client/pom.xml.

Run: ``python -m devtools.hivemetastore [--port 9083] [--data-dir DIR]`` serves one until interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from xml.sax.saxutils import escape

from devtools.kafkabroker import free_port, setup_cache_dir
from devtools.processes import stop_process

HIVE_POM = Path(__file__).resolve().parent / "hive" / "pom.xml"
HIVE_CLIENT_POM = Path(__file__).resolve().parent / "hive" / "client" / "pom.xml"
HIVE_CLIENT_VERSION = "4.0.1"  # spark.sql.hive.metastore.version of the client in HIVE_CLIENT_POM
# A metastore serving a test session's few tables needs little heap; C2's compiling costs more
# than it gains in a server living minutes. Hive 4 reflects into java.lang on Java 17.
METASTORE_JVM_OPTIONS = ["-Xmx256m", "-Xms32m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                         "--add-opens", "java.base/java.lang=ALL-UNNAMED"]
# Every metastore started here, with the process that started it: stopped at its exit at the latest.
_metastores: list[tuple[int, "DevMetastore"]] = []


class DevMetastore:
    """A metastore running in a JVM of ours, with its directory (settings, database, log)."""

    def __init__(self, uri: str, process: subprocess.Popen, root: Path, temporary: bool):
        self.uri, self.process, self.root, self.temporary = uri, process, root, temporary

    @property
    def log_path(self) -> Path:
        return self.root / "metastore.log"

    @property
    def port(self) -> int:
        return int(self.uri.rsplit(":", 1)[1])

    def stop(self) -> None:
        stop_process(self.process)
        if self.temporary:
            shutil.rmtree(self.root, ignore_errors=True)


def metastore_jars_dir() -> Path:
    """The jars scripts/setup copied for devtools/hive/pom.xml."""
    return setup_cache_dir(HIVE_POM, "hive", "the Hive Metastore's jars")


def client_jars_dir() -> Path:
    """The Hive client jars scripts/setup copied for devtools/hive/client/pom.xml."""
    return setup_cache_dir(HIVE_CLIENT_POM, "hive-client", "the Hive Metastore client's jars (for Spark)")


def reader_conf(uri: str) -> dict[str, str]:
    """Spark settings of a session whose catalog is the metastore at ``uri`` (with delta-spark's,
    devtools.sparkjars.DELTA_CONF, it reads the Delta tables registered there by name)."""
    return {
        "spark.sql.catalogImplementation": "hive",
        "spark.hadoop.hive.metastore.uris": uri,
        "spark.sql.hive.metastore.version": HIVE_CLIENT_VERSION,
        "spark.sql.hive.metastore.jars": "path",
        "spark.sql.hive.metastore.jars.path": f"{client_jars_dir().as_uri()}/*",
    }


def start_metastore(port: int = 0, data_dir: str | os.PathLike | None = None, seconds: float = 120) -> DevMetastore:
    """A metastore on 127.0.0.1 (a free port unless given) whose Derby database, warehouse
    directory, settings and log are in ``data_dir`` (kept) or a temporary directory (removed by
    ``stop()``). The database's tables are created on the first start (DataNucleus's
    autoCreateAll; no schema tool run)."""
    jars = metastore_jars_dir()
    root = Path(data_dir).resolve() if data_dir else Path(tempfile.mkdtemp(prefix="oncemore-metastore-"))
    (root / "conf").mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    settings = {
        "javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={root / 'metastore_db'};create=true",
        "javax.jdo.option.ConnectionDriverName": "org.apache.derby.jdbc.EmbeddedDriver",
        "datanucleus.schema.autoCreateAll": "true",
        "metastore.schema.verification": "false",
        "metastore.thrift.bind.host": "127.0.0.1",
        "metastore.thrift.port": str(port),
        "metastore.warehouse.dir": str(root / "warehouse"),
        # Background threads a test metastore has no use for (compaction, statistics, events).
        "metastore.compactor.initiator.on": "false",
        "metastore.housekeeping.threads.on": "false",
    }
    (root / "conf" / "metastore-site.xml").write_text(
        "<configuration>\n" + "".join(f"  <property><name>{escape(k)}</name><value>{escape(v)}</value></property>\n"
                                      for k, v in settings.items()) + "</configuration>\n")
    (root / "tmp").mkdir(exist_ok=True)
    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    command = [java, *METASTORE_JVM_OPTIONS, f"-Djava.io.tmpdir={root / 'tmp'}", f"-Dderby.system.home={root}",
               "-cp", f"{root / 'conf'}{os.pathsep}{jars / '*'}", "org.apache.hadoop.hive.metastore.HiveMetaStore"]
    with (root / "metastore.log").open("a") as log:
        process = subprocess.Popen(command, cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    metastore = DevMetastore(f"thrift://127.0.0.1:{port}", process, root, temporary=data_dir is None)
    _metastores.append((os.getpid(), metastore))
    try:
        _wait_serving(metastore, seconds)
    except BaseException:
        metastore.stop()
        raise
    return metastore


def _wait_serving(metastore: DevMetastore, seconds: float) -> None:
    """Returns once the metastore lists its databases; raises with its log's end if it exits or
    takes longer."""
    from pymetastore.hive_metastore import ThriftHiveMetastore
    from thrift.protocol.TBinaryProtocol import TBinaryProtocol
    from thrift.Thrift import TException
    from thrift.transport import TSocket, TTransport

    deadline, last_error = time.monotonic() + seconds, "its port never opened"
    while metastore.process.poll() is None and time.monotonic() < deadline:
        socket = TSocket.TSocket("127.0.0.1", metastore.port)
        socket.setTimeout(10_000)
        transport = TTransport.TBufferedTransport(socket)
        try:
            transport.open()
            ThriftHiveMetastore.Client(TBinaryProtocol(transport)).get_all_databases()
            return
        except TException as failure:  # not listening yet, or its database not ready
            last_error = str(failure)
        finally:
            transport.close()
        time.sleep(0.2)
    if metastore.process.poll() is not None:
        problem = f"exited with code {metastore.process.returncode} while starting"
    else:
        problem = f"did not serve within {seconds:.0f}s ({last_error})"
    tail = "".join(metastore.log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
    raise RuntimeError(f"the Hive Metastore at {metastore.uri} {problem}; the end of its log:\n{tail}")


@atexit.register
def _stop_metastores_left_running() -> None:
    """A metastore nobody stopped (a script that raised, a fixture that never finished) ends with
    this interpreter rather than outlive it. Not a forked child's: the metastores are its parent's."""
    for starter, metastore in _metastores:
        if starter == os.getpid():
            metastore.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devtools.hivemetastore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9083, help="0 picks a free port (default 9083)")
    parser.add_argument("--data-dir", help="keep the database here (default: a temporary directory)")
    args = parser.parse_args(argv)
    metastore = start_metastore(args.port, args.data_dir)
    print(metastore.uri, flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops it as Ctrl-C does
    try:
        metastore.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        metastore.stop()


if __name__ == "__main__":
    main()
