"""Apicurio Registry, the schema registry of the demo, the tests and the benchmarks: a real one,
Confluent-compatible over HTTP, so that every process (Spark's Python workers, CLI subprocesses)
reaches the same registry, through the same client as a deployment's Confluent registry
(docker-compose.yaml). confluent-kafka's ``mock://`` registry lives inside one process only.

``start_registry()`` runs the Apicurio application scripts/setup unpacked for
devtools/registry/pom.xml, on free ports of 127.0.0.1 with an in-memory H2 database, and returns
once its Confluent-compatible API answers; ``DevRegistry.url`` is that API's base, the ``url``
confluent-kafka's ``SchemaRegistryClient`` takes. Schema IDs are Apicurio's content IDs: the same
schema has one ID in every subject, as in Confluent's. It never leaves its JVM behind: not when
stopped, when it fails to start, or when the interpreter that started it exits.

``start_detached_registry()``: the same registry for a developer's own schemas, on a fixed port,
outliving the command that starts it, its schemas kept between starts (an H2 database file in its
data directory). Run (scripts/registry):
``python -m devtools.schemaregistry start [--port 8081] [--data-dir DIR] | stop | status``.
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from devtools.kafkabroker import free_port, setup_cache_dir
from devtools.processes import serve_main, start_detached, stop_process

REGISTRY_POM = Path(__file__).resolve().parent / "registry" / "pom.xml"
# Measured on 2 cores shared with other work (load 7-9): from the JVM's start to a first answer
# 4-6.5 s with these, 7.5-17 s with the JVM's defaults; an idle registry 180 MB resident, not
# 260-275 MB. C2's compiling costs more than it gains in a registry living minutes, and a test
# session's schemas fit a small heap.
REGISTRY_JVM_OPTIONS = ["-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"]
# The realm name in the digest of an embedded user's password (Quarkus's default).
EMBEDDED_REALM = "Quarkus"
# Every registry started here, with the process that started it: stopped at its exit at the latest.
_registries: list[tuple[int, DevRegistry]] = []


class DevRegistry:
    """A registry running in a JVM of ours, with its settings, log and temporary directory."""

    def __init__(self, url: str, process: subprocess.Popen, log_path: Path, temporary_dir: Path,
                 user_info: str | None = None):
        self.url, self.process, self.log_path = url, process, log_path
        self.temporary_dir, self.user_info = temporary_dir, user_info

    def settings(self) -> dict[str, str]:
        """``schema_registry:`` settings for a pipeline against this registry (confluent-kafka's)."""
        return {"url": self.url, **({"basic.auth.user.info": self.user_info} if self.user_info else {})}

    def stop(self) -> None:
        stop_process(self.process)
        shutil.rmtree(self.temporary_dir, ignore_errors=True)


def registry_app_dir() -> Path:
    """The Apicurio application scripts/setup unpacked for devtools/registry/pom.xml."""
    return setup_cache_dir(REGISTRY_POM, "registry", "the schema registry's files (Apicurio Registry)")


def start_registry(port: int = 0, user_info: str | None = None, seconds: float = 120) -> DevRegistry:
    """Apicurio on 127.0.0.1 (a free port unless given), its management interface on another free
    port; with ``user_info`` ("user:password") every request needs those HTTP basic credentials.

    Its configuration, log and temporary files live in a temporary directory that ``stop()``
    removes, its schemas in memory. The password reaches neither a command line (a process list
    shows every one) nor that directory: only its digest does (MD5 of user:realm:password, as
    Quarkus's embedded users take it)."""
    runner = _registry_runner()
    properties = _registry_properties(port or free_port())
    if user_info:
        properties.update(_basic_auth_properties(user_info))
    temporary_dir = Path(tempfile.mkdtemp(prefix="oncemore-registry-"))
    command = _registry_command(runner, temporary_dir, properties)
    log_path = temporary_dir / "registry.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=temporary_dir, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT)
    registry = DevRegistry(_ccompat_url(properties), process, log_path, temporary_dir, user_info)
    _registries.append((os.getpid(), registry))
    try:
        _wait_serving(registry.url, process, log_path, user_info, seconds)
    except BaseException:
        registry.stop()
        raise
    return registry


def start_detached_registry(data_dir: Path, port: int = 8081, seconds: float = 120) -> int:
    """Starts the registry of ``data_dir`` on 127.0.0.1:``port``, detached (devtools.processes),
    its schemas in an H2 database file there (created by the first start), and returns its pid
    once it serves."""
    properties = {**_registry_properties(port), "apicurio.datasource.url": f"jdbc:h2:file:{data_dir / 'db' / 'registry'}"}
    command = _registry_command(_registry_runner(), data_dir, properties)
    log_path = data_dir / "registry.log"
    return start_detached(command, data_dir, log_path,
                          lambda process: _wait_serving(_ccompat_url(properties), process, log_path, None, seconds))


def detached_registry_address(data_dir: Path) -> tuple[int, str]:
    """The port and Confluent-compatible URL the registry of ``data_dir`` serves on."""
    for line in (data_dir / "config" / "application.properties").read_text().splitlines():
        if line.startswith("quarkus.http.port="):
            port = int(line.split("=", 1)[1])
            return port, _ccompat_url({"quarkus.http.port": str(port)})
    raise ValueError(f"{data_dir / 'config' / 'application.properties'} names no port")


def _registry_properties(port: int) -> dict[str, str]:
    return {
        "quarkus.http.host": "127.0.0.1",
        "quarkus.http.port": str(port),
        # Health and metrics: a port of their own, on loopback too.
        "quarkus.management.host": "127.0.0.1",
        "quarkus.management.port": str(free_port()),
        # SQL storage on H2; with no URL of ours, an in-memory database of its own, gone with the JVM.
        "apicurio.storage.kind": "sql",
        "apicurio.storage.sql.kind": "h2",
        # A schema registered again in another layout (JSON's whitespace) is the one already there,
        # its ID and version, as in Confluent's registry; by default Apicurio adds a version.
        "apicurio.ccompat.use-canonical-hash": "true",
    }


def _registry_runner() -> Path:
    return next(registry_app_dir().glob("apicurio-registry-app-*-runner.jar"))


def _registry_command(runner: Path, directory: Path, properties: dict[str, str]) -> list[str]:
    """Writes ``properties`` where Quarkus reads them (config/application.properties in its working
    directory, ``directory``) and returns the command that runs Apicurio's ``runner`` there."""
    (directory / "config").mkdir(exist_ok=True)
    (directory / "config" / "application.properties").write_text(
        "".join(f"{key}={value}\n" for key, value in properties.items()))
    (directory / "tmp").mkdir(exist_ok=True)  # the JVM's and Vert.x's temporary files
    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    return [java, *REGISTRY_JVM_OPTIONS, f"-Djava.io.tmpdir={directory / 'tmp'}", "-jar", str(runner)]


def _ccompat_url(properties: dict[str, str]) -> str:
    return f"http://127.0.0.1:{properties['quarkus.http.port']}/apis/ccompat/v7"


def _basic_auth_properties(user_info: str) -> dict[str, str]:
    """Quarkus's HTTP basic authentication against one embedded user (its properties-file realm,
    built into Apicurio's application): Apicurio then answers 401, to reads and writes alike, to a
    request without that user's credentials; no OIDC server is involved."""
    user, colon, password = user_info.partition(":")
    # The user name is a segment of a property name: anything else would need quoting there.
    if not colon or not re.fullmatch(r"[A-Za-z0-9_-]+", user):
        raise ValueError("user_info for the local registry is user:password, the user of letters, digits, _ and -")
    digest = hashlib.md5(f"{user}:{EMBEDDED_REALM}:{password}".encode()).hexdigest()
    return {"quarkus.http.auth.basic": "true", f"quarkus.security.users.embedded.users.{user}": digest}


def _wait_serving(url: str, process: subprocess.Popen, log_path: Path, user_info: str | None,
                  seconds: float) -> None:
    """Returns once the registry at ``url`` lists its subjects (its database is ready by then, and
    with ``user_info`` it took the credentials); raises with its log's end if it exits or takes longer."""
    request = urllib.request.Request(f"{url}/subjects")
    if user_info:
        request.add_header("Authorization", "Basic " + base64.b64encode(user_info.encode()).decode())
    deadline, last_error = time.monotonic() + seconds, "its port never opened"
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                answer.read()
                return
        except urllib.error.HTTPError as failure:
            last_error = f"HTTP {failure.code}"
        except OSError as failure:  # not listening yet
            last_error = str(failure)
        time.sleep(0.1)
    if process.poll() is not None:
        problem = f"exited with code {process.returncode} while starting"
    else:
        problem = f"did not serve within {seconds:.0f}s ({last_error})"
    tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
    raise RuntimeError(f"the schema registry at {url} {problem}; the end of its log:\n{tail}")


@atexit.register
def _stop_registries_left_running() -> None:
    """A registry nobody stopped (a script that raised, a fixture that never finished) ends with
    this interpreter rather than outlive it. Not a forked child's: the registries are its parent's."""
    for starter, registry in _registries:
        if starter == os.getpid():
            registry.stop()


if __name__ == "__main__":
    raise SystemExit(serve_main(None, prog="scripts/registry", what="the schema registry", name="registry",
                                default_port=8081, start=start_detached_registry, address=detached_registry_address))
