"""A local Spark Connect server from the pip-installed PySpark (its jars ship the server), for
resident-Spark runs and the tests: started and stopped by whoever calls ``start_connect_server``.

The server is a Spark driver of its own (``local[N]`` here): its Python workers import what each
client session ships as an artifact (oncemore's package zip) and what is installed where they run
(the same virtualenv here, through PYSPARK_PYTHON). They fork from oncemore.run.workerdaemon, which
has the libraries they import loaded: a run after Spark stopped its idle workers starts faster.
Restarting it on the same port is what an operator does after a crash; clients reconnect with a
new session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from devtools.kafkabroker import free_port, wait_listening
from devtools.processes import stop_process
from oncemore.core.redaction import SPARK_CONF_REGEX
from oncemore.run.session import WORKER_DAEMON

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


class ConnectServer:
    def __init__(self, port: int, master: str, log_dir: str,
                 jars: Sequence[str | os.PathLike] = (), conf: Mapping[str, str] | None = None):
        self.port, self.master, self.log_dir = port, master, log_dir
        # More jars on the server's classpath (spark-submit --jars) and Spark settings of the
        # server's: a session of another engine's (delta-spark, sparkjars.py), kept across restarts.
        self.jars, self.conf = [str(j) for j in jars], dict(conf or {})
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.log_dir) / "connect-server.log"

    @property
    def event_dir(self) -> Path:
        return Path(self.log_dir) / "events"

    def start(self, seconds: float = 120) -> "ConnectServer":
        import pyspark

        import oncemore

        # The worker daemon (oncemore.run.workerdaemon) is imported from this checkout's package.
        package_parent = str(Path(oncemore.__file__).resolve().parents[1])
        env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
               "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
        env.pop("SPARK_REMOTE", None)  # the server is a classic driver; a client variable would turn it into one
        command = [str(Path(pyspark.__file__).parent / "bin" / "spark-submit"), "--class", SERVER_CLASS,
                   "--master", self.master, "--conf", f"spark.connect.grpc.binding.port={self.port}",
                   "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
                   "--conf", f"spark.python.daemon.module={WORKER_DAEMON}",
                   "--conf", f"spark.redaction.regex={SPARK_CONF_REGEX}", "--conf", "spark.ui.enabled=false",
                   # What the server records of each session's statements, for a test to read back.
                   "--conf", "spark.eventLog.enabled=true", "--conf", f"spark.eventLog.dir={self.event_dir}",
                   "--conf", "spark.eventLog.compress=false",
                   *(["--jars", ",".join(self.jars)] if self.jars else []),
                   *[part for key, value in self.conf.items() for part in ("--conf", f"{key}={value}")],
                   "spark-internal"]
        self.event_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_listening(self.process, self.port, f"Spark Connect server (log: {self.log_path})", seconds)
        return self

    def kill(self) -> None:
        """Dies at once (SIGKILL): a crashed server, as a client mid-run sees it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, grace_seconds=20)


def start_connect_server(master: str = "local[2]", port: int | None = None, log_dir: str | None = None,
                         jars: Sequence[str | os.PathLike] = (),
                         conf: Mapping[str, str] | None = None) -> ConnectServer:
    """A Connect server on 127.0.0.1 (a free port unless ``port``), accepting sessions on return;
    ``jars`` and ``conf``: more jars for its classpath and Spark settings (sparkjars.start_delta_connect_server's Delta)."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="oncemore-connect-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return ConnectServer(port or free_port(), master, log_dir, jars, conf).start()
