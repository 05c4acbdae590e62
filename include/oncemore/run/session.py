"""A Spark session able to run oncemore jobs: the package shipped to executors (each job registers
the data sources it reads and writes).

Imported only once a run has work to do: a no-op run never starts a JVM.
"""

from __future__ import annotations

import logging
import os
import site
import sys
import tempfile
import weakref
import zipfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from oncemore.core.errors import SparkConnectError
from oncemore.core.redaction import SPARK_CONF_REGEX, spark_options_regex, spark_statement_regex
from oncemore.run import classarchive, connectslots
from oncemore.run.workerdaemon import OWN_WORKERS_ENV

MASTER_ENV = "ONCEMORE_SPARK_MASTER"
REMOTE_ENV = "SPARK_REMOTE"  # PySpark's own: a Spark Connect server (sc://host:15002)
WORKER_DAEMON = "oncemore.run.workerdaemon"

# Session settings every oncemore job relies on. librdkafka, registry and storage settings travel
# inside the tasks' functions, and as data source options (kafka.*, storage.*) where a Data Source
# reads (oncemore_kafka, verify's scans): every one not known harmless is masked in plans, logs and
# the UI (redaction.py). All are runtime SQL settings, so a Spark Connect session
# sets them on a server that was started without them.
SESSION_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.redaction.options.regex": spark_options_regex(),
    "spark.sql.execution.arrow.maxRecordsPerBatch": "50000",
}

# The environment of the Python workers of a session oncemore starts (spark.executorEnv.*: on a
# cluster, its executors' too), each unless the driver's own environment sets it: Arrow's memory from
# the system's allocator, glibc's malloc in two arenas rather than one per thread (the Kafka client's
# among them), and the mark that lets a task keep pandas out (workermemory.py). A value set
# as spark.executorEnv.* in spark-defaults.conf is replaced. A 1 M-record run's tree peaked ~70 MiB
# lower with the first two, ~60 lower again with the third (docs/performance.md, "Memory beside the peer").
WORKER_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_ARENA_MAX": "2", OWN_WORKERS_ENV: "1"}

# The driver JVM of a session oncemore starts plans jobs and carries their tasks' results (its Python
# workers read, decode and write), yet Java sizes it as for any work: G1, whose own structures took
# ~50 MiB, and a young generation sized from an initial heap of 1/64 of the machine's memory, filled
# before the first collection. A serial collector whose young generation starts at 16 MiB (and grows
# with the heap, up to spark.driver.memory, where a job needs it) held it at ~325 MiB over a
# 1 M-record Avro run, against 371-392 with G1 (docs/performance.md, "Memory beside the peer").
DRIVER_JVM_MEMORY = "-XX:+UseSerialGC -XX:NewSize=16m"
# Where the user gives the JVM options of their own (a second collector would stop it from
# starting; a spark.driver.extraJavaOptions of theirs would be replaced; a heap of theirs may be
# too large for one collector thread): the variables every JVM reads, those Spark's launcher reads,
# and Spark's configuration directory, by variable or by these files in Spark's home.
USER_JVM_ENV = (*classarchive.JAVA_OPTIONS_ENV, "PYSPARK_SUBMIT_ARGS", "SPARK_SUBMIT_OPTS", "SPARK_JAVA_OPTS",
                "SPARK_DRIVER_MEMORY", "SPARK_MEM", "SPARK_CONF_DIR")
USER_JVM_FILES = ("spark-defaults.conf", "spark-env.sh", "java-opts")
# What may name a master where none is given here (spark-submit's MASTER, submit arguments, a
# configuration directory; and Spark home's spark-defaults.conf): else Spark's default, local[*].
MASTER_NAMING_ENV = ("MASTER", "PYSPARK_SUBMIT_ARGS", "SPARK_CONF_DIR")


def spark_session(master: str | None = None, remote: str | None = None, output: Path | None = None):
    """A session on ``remote`` (a Spark Connect URL) or on ``master``; with neither, on
    $SPARK_REMOTE, else $ONCEMORE_SPARK_MASTER, else Spark's own default master. ``output``: a
    file that takes everything the JVM this starts prints (its start-up warnings and Spark's
    console log, its Python workers' too) instead of the terminal."""
    from pyspark.sql import SparkSession

    remote = remote or (None if master else os.environ.get(REMOTE_ENV))
    if remote:
        return connect_session(remote)
    os.environ.pop(REMOTE_ENV, None)  # a master named over $SPARK_REMOTE: PySpark would follow the variable
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("oncemore")
    master = master or os.environ.get(MASTER_ENV)
    if master:
        builder = builder.master(master)
    for key, value in SESSION_CONF.items():
        builder = builder.config(key, value)
    builder = builder.config("spark.redaction.regex", SPARK_CONF_REGEX).config("spark.ui.showConsoleProgress", "false")
    # PySpark broadcasts a task function whose pickle passes this (1 MiB by default), and a
    # broadcast is a file under spark.local.dir on the driver and each executor, left behind by a
    # killed run. The functions of oncemore's jobs hold the Kafka and storage credentials
    # (kafkasource.IngestTasks, rewritejob.py) and all their tasks' ranges: never to a file.
    builder = builder.config("spark.broadcast.UDFCompressionThreshold", "1t")
    for key, value in WORKER_ENV.items():
        builder = builder.config(f"spark.executorEnv.{key}", os.environ.get(key, value))
    java_options = driver_java_options()
    if java_options:
        builder = builder.config("spark.driver.extraJavaOptions", java_options)
    if workers_import_oncemore_here(master):
        builder = builder.config("spark.python.daemon.module", WORKER_DAEMON)
    with output_to(output):
        spark = builder.getOrCreate()
    if "oncemore" not in spark.conf.get("spark.submit.pyFiles", ""):
        spark.sparkContext.addPyFile(package_zip())
    return spark


def log_to(log: Path) -> None:
    """The logs of Spark's Python side into ``log``, not the terminal: PySpark logs every error of a
    query it raises as JSON with the JVM's stack (its query-context loggers), and py4j the
    tracebacks of a gateway call that broke (a JVM stopped by Ctrl-C), before oncemore's own
    one-line error."""
    import py4j
    from pyspark import SparkContext
    from pyspark.logger import PySparkLogger

    handler = logging.FileHandler(log, delay=True)
    spark_side = logging.getLogger("oncemore.spark")
    for logger in [PySparkLogger.getLogger(name) for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger")
                   ] + [logging.getLogger("py4j"), spark_side]:
        logger.handlers = [handler]
        logger.propagate = False
    # py4j logs a broken call's traceback on the root logger (logging.exception): taken aside there.
    py4j_code = os.path.dirname(py4j.__file__)

    def aside(record: logging.LogRecord) -> bool:
        if record.pathname.startswith(py4j_code):
            handler.handle(record)
            return False
        return True

    logging.getLogger().addFilter(aside)
    # PySpark's accumulator server prints the traceback of a connection the JVM broke off itself.
    server = getattr(SparkContext._active_spark_context, "_accumulatorServer", None)
    if server is not None:
        server.handle_error = lambda _request, address: spark_side.exception("accumulator update from %s", address)


def driver_java_options() -> str | None:
    """The options of the driver JVM this process is about to start: its memory's (DRIVER_JVM_MEMORY,
    unless the user gives the JVM options of their own: ``jvm_options_are_users``) and the class
    archive's (classarchive.py); None when there are none, or no JVM is started here (one runs
    already, or spark-submit started it)."""
    import pyspark

    if not starts_jvm():
        return None
    home = spark_home()
    options = [None if jvm_options_are_users(home) else DRIVER_JVM_MEMORY,
               classarchive.java_options(pyspark.__version__, home)]
    return " ".join(o for o in options if o) or None


def workers_import_oncemore_here(master: str | None) -> bool:
    """Whether the Python workers of the session about to start can fork from oncemore's daemon
    (workerdaemon.py: PySpark from its installed package, not compiled again from Spark home's zip):
    this process starts its JVM, on a local master (``master``, else Spark's default local[*] where
    nothing of the user's may name another), its workers run this interpreter, and it finds this
    package without help (the environment's PYTHONPATH, its site directories, the working
    directory, as the daemon looks). Otherwise Spark's own daemon, as before."""
    if not starts_jvm() or os.path.realpath(os.environ.get("PYSPARK_PYTHON", sys.executable)) != os.path.realpath(
            sys.executable):
        return False
    if master is None and (any(os.environ.get(name) for name in MASTER_NAMING_ENV)
                           or Path(spark_home(), "conf", "spark-defaults.conf").exists()):
        return False
    if not (master or "local").startswith("local"):
        return False
    searched = [*os.environ.get("PYTHONPATH", "").split(os.pathsep), *site.getsitepackages(),
                site.getusersitepackages(), os.getcwd()]
    return os.path.realpath(Path(__file__).parents[2]) in {os.path.realpath(p) for p in searched if p}


def starts_jvm() -> bool:
    """Whether the session about to start starts its driver JVM in this process: none runs yet, and
    spark-submit did not start one for it."""
    from pyspark import SparkContext

    return SparkContext._active_spark_context is None and not os.environ.get("PYSPARK_GATEWAY_PORT")


def spark_home() -> str:
    """The Spark home of the JVM this process would start (the pyspark package's, unless set)."""
    import pyspark

    return os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)


def jvm_options_are_users(home: str) -> bool:
    """Whether the user gives the driver JVM options of their own (USER_JVM_ENV, USER_JVM_FILES)."""
    return (any(os.environ.get(name) for name in USER_JVM_ENV)
            or any(Path(home, "conf", name).exists() for name in USER_JVM_FILES))


@contextmanager
def output_to(path: Path | None) -> Iterator[None]:
    """Within: this process's stdout and stderr descriptors write to ``path`` (appended), so a
    process started here (the JVM) keeps writing there after; restored on the way out."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in (*saved, target):
            os.close(descriptor)


def connect_session(remote: str):
    """A Spark Connect session on the server at ``remote`` for this run: the session of the first
    free slot of this host (connectslots.py), so its Python workers and the package's artifact
    serve run after run, or a new one (the URL names its own ``session_id``, no slot is free).
    The package reaches the server's Python workers as the session's artifact. End the run's use
    of it with ``stop_session``."""
    from pyspark.sql import SparkSession

    _connect_client_log_capped()
    address, _, parameters = remote.partition("/;")  # sc://host:port; the parameters may hold a token
    address = address.rstrip("/")  # the Spark provider's hook writes sc://host:port/
    named = {p.split("=", 1)[0] for p in parameters.split(";") if p}
    slot = None if "session_id" in named else connectslots.take_slot(
        address + "".join(f";{p}" for p in parameters.split(";") if p.startswith("user_id=")),
        Path(package_zip()).read_bytes())
    for attempt in range(2):
        url = remote if slot is None else f"{address}/;{parameters + ';' if parameters else ''}session_id={slot.session_id}"
        spark = None
        try:
            spark = SparkSession.builder.remote(url).create()
            for key, value in {**SESSION_CONF, "spark.sql.redaction.string.regex": spark_statement_regex()}.items():
                spark.conf.set(key, value)
            break
        except Exception as exc:  # PySpark's message quotes the URL, and a URL may carry a token
            if spark is not None:  # refused: its client closed now, or it calls the server as Python exits
                spark.release_session_on_close = False
                spark.stop()
            if slot is not None and attempt == 0 and "SESSION_CLOSED" in str(exc):
                slot.renew()  # the server closed the slot's session (idle timeout): a new one
                continue
            if slot is not None:
                slot.release()
            raise SparkConnectError(f"no Spark Connect session on {address}: {type(exc).__name__}",
                                    server=address) from None
    if slot is not None:
        spark.release_session_on_close = False  # kept on the server for the slot's next run
        _SLOTS[id(spark)] = slot
    try:
        spark.addArtifacts(package_zip(), pyfile=True)
    except Exception as exc:
        stop_session(spark)
        raise SparkConnectError(f"Spark Connect session on {address} refused the package: {type(exc).__name__}",
                                server=address) from None
    return spark


def _connect_client_log_capped() -> None:
    """PySpark's Connect client at DEBUG (SPARK_CONNECT_LOG_LEVEL=debug) logs each request in full,
    where no Spark redaction reaches: every data source option's value (kafka.*, storage.*) and the
    pickled functions its tasks run, whose text holds what they captured (the ingest job's and
    the cluster MERGE's tasks carry the Kafka and object store credentials: kafkasource.py,
    rewritejob.py). So it logs at INFO at most."""
    from pyspark.sql.connect.logging import logger

    if logger.isEnabledFor(logging.DEBUG):
        logger.setLevel(logging.INFO)
        logging.getLogger(__name__).warning(
            "SPARK_CONNECT_LOG_LEVEL=debug: PySpark's Connect client logs at INFO in oncemore's runs "
            "(at DEBUG it logs every plan in full, credentials included)")


# The slot each Connect session of this process holds, by id(session), until stop_session.
_SLOTS: dict[int, connectslots.Slot] = {}


def stop_session(spark) -> None:
    """Ends this run's use of ``spark``: a classic session stops; a Connect session in a slot stays
    on the server for the slot's next run, its client closes and its slot is free again; any other
    Connect session is released on the server with its artifacts and views."""
    slot = _SLOTS.pop(id(spark), None)
    try:
        if slot is not None:
            # A job still running (the run failed or was stopped meanwhile) must not outlive the
            # run in a session the next run takes. Best effort: a dead server has none running.
            try:
                spark.interruptAll()
            except Exception:
                pass
        spark.stop()
    finally:
        if slot is not None:
            slot.release()


# The data sources registered in each session, by session: registered once, as Spark warns each
# time a name is registered again.
_REGISTERED: "weakref.WeakKeyDictionary[object, set[str]]" = weakref.WeakKeyDictionary()


def register_source(spark, source) -> None:
    """Registers the Python Data Source class ``source`` in ``spark``, once per session: each job
    registers what it reads (a verify its table scan)."""
    names = _REGISTERED.setdefault(spark, set())
    if source.name() not in names:
        spark.dataSource.register(source)
        names.add(source.name())


def slots(spark) -> int:
    """How many tasks the cluster runs at once (Spark Connect has no SparkContext to ask)."""
    try:
        return spark.sparkContext.defaultParallelism
    except Exception:  # Spark Connect
        return int(spark.conf.get("spark.default.parallelism", None) or os.cpu_count() or 1)


@lru_cache(maxsize=1)
def package_zip() -> str:
    """The oncemore package as a zip for --py-files / addPyFile / addArtifacts (executors must not
    rely on the driver's cwd)."""
    package = Path(__file__).resolve().parents[1]
    target = Path(tempfile.mkdtemp(prefix="oncemore-pkg-")) / "oncemore.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(package.rglob("*.py")):
            archive.write(path, path.relative_to(package.parent))
    return str(target)
