"""A local Spark standalone cluster (one master, one or more workers) from the pip-installed PySpark,
for local runs, the tests and the cluster benchmarks: started and stopped by whoever calls
``start_spark_cluster``.

Executors are separate JVMs with their own Python workers (one executor per worker for each
application): what a job imports travels with it (oncemore's package zip) or is installed where
they run (here, the same virtualenv).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from devtools.kafkabroker import free_port, wait_listening
from devtools.processes import stop_process


class SparkCluster:
    def __init__(self, master_url: str, processes: list[subprocess.Popen], log_dir: str):
        self.master_url, self.processes, self.log_dir = master_url, processes, log_dir

    @property
    def workers(self) -> list[subprocess.Popen]:
        """The workers' processes (an application's executors are their children)."""
        return self.processes[1:]

    def stop(self) -> None:
        for process in reversed(self.processes):  # the workers first, so the master sees them leave
            stop_process(process, grace_seconds=15)


def _spark_class() -> str:
    import pyspark

    return str(Path(pyspark.__file__).parent / "bin" / "spark-class")


def start_spark_cluster(cores: int = 2, memory: str = "2g", log_dir: str | None = None, workers: int = 1) -> SparkCluster:
    """A master on 127.0.0.1 and ``workers`` workers, each its own process with ``cores`` and
    ``memory`` (so each runs its own executor JVM), all registered before this returns."""
    log_dir = log_dir or tempfile.mkdtemp(prefix="oncemore-spark-")
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
           "SPARK_WORKER_DIR": str(Path(log_dir) / "work")}
    port, ui = free_port(), free_port()
    master_log = Path(log_dir) / "master.log"
    master = subprocess.Popen([_spark_class(), "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(port), "--webui-port", str(ui)],
                              env=env, stdout=master_log.open("w"), stderr=subprocess.STDOUT)
    processes = [master]
    try:
        wait_listening(master, port, f"Spark master (log: {master_log})", 60)
        url = f"spark://127.0.0.1:{port}"
        logs = []
        for number in range(workers):
            worker_log = Path(log_dir) / f"worker-{number}.log"
            processes.append(subprocess.Popen(
                [_spark_class(), "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                 "--cores", str(cores), "--memory", memory, "--webui-port", str(free_port())],
                env=env, stdout=worker_log.open("w"), stderr=subprocess.STDOUT))
            logs.append(worker_log)
        deadline = time.monotonic() + 60
        for worker, worker_log in zip(processes[1:], logs, strict=True):
            while "Successfully registered with master" not in worker_log.read_text():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Spark worker did not register with {url}; see {worker_log}")
                time.sleep(0.2)
        return SparkCluster(url, processes, log_dir)
    except BaseException:
        SparkCluster("", processes, log_dir).stop()
        raise
