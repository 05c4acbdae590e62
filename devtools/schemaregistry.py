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

Run: ``python -m devtools.schemaregistry [--port 8081]`` serves one until interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from devtools.kafkabroker import free_port, setup_cache_dir
from devtools.processes import stop_process

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
    removes. The password reaches neither a command line (a process list shows every one) nor that
    directory: only its digest does (MD5 of user:realm:password, as Quarkus's embedded users take it)."""
    app = registry_app_dir()
    runner = next(app.glob("apicurio-registry-app-*-runner.jar"))
    properties = {
        "quarkus.http.host": "127.0.0.1",
        "quarkus.http.port": str(port or free_port()),
        # Health and metrics: a port of their own, on loopback too.
        "quarkus.management.host": "127.0.0.1",
        "quarkus.management.port": str(free_port()),
        # SQL storage on H2 with no URL of ours: an in-memory database of its own, gone with the JVM.
        "apicurio.storage.kind": "sql",
        "apicurio.storage.sql.kind": "h2",
        # A schema registered again in another layout (JSON's whitespace) is the one already there,
        # its ID and version, as in Confluent's registry; by default Apicurio adds a version.
        "apicurio.ccompat.use-canonical-hash": "true",
    }
    if user_info:
        properties.update(_basic_auth_properties(user_info))
    temporary_dir = Path(tempfile.mkdtemp(prefix="oncemore-registry-"))
    # Quarkus reads config/application.properties in its working directory.
    (temporary_dir / "config").mkdir()
    (temporary_dir / "config" / "application.properties").write_text(
        "".join(f"{key}={value}\n" for key, value in properties.items()))
    (temporary_dir / "tmp").mkdir()  # the JVM's and Vert.x's temporary files
    log_path = temporary_dir / "registry.log"
    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else "java"
    command = [java, *REGISTRY_JVM_OPTIONS, f"-Djava.io.tmpdir={temporary_dir / 'tmp'}", "-jar", str(runner)]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=temporary_dir, stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT)
    registry = DevRegistry(f"http://127.0.0.1:{properties['quarkus.http.port']}/apis/ccompat/v7", process,
                           log_path, temporary_dir, user_info)
    _registries.append((os.getpid(), registry))
    try:
        _wait_serving(registry, seconds)
    except BaseException:
        registry.stop()
        raise
    return registry


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


def _wait_serving(registry: DevRegistry, seconds: float) -> None:
    """Returns once the registry lists its subjects (its database is ready by then, and with
    ``user_info`` it took the credentials); raises with its log's end if it exits or takes longer."""
    request = urllib.request.Request(f"{registry.url}/subjects")
    if registry.user_info:
        request.add_header("Authorization", "Basic " + base64.b64encode(registry.user_info.encode()).decode())
    deadline, last_error = time.monotonic() + seconds, "its port never opened"
    while registry.process.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                answer.read()
                return
        except urllib.error.HTTPError as failure:
            last_error = f"HTTP {failure.code}"
        except OSError as failure:  # not listening yet
            last_error = str(failure)
        time.sleep(0.1)
    if registry.process.poll() is not None:
        problem = f"exited with code {registry.process.returncode} while starting"
    else:
        problem = f"did not serve within {seconds:.0f}s ({last_error})"
    tail = "".join(registry.log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
    raise RuntimeError(f"the schema registry at {registry.url} {problem}; the end of its log:\n{tail}")


@atexit.register
def _stop_registries_left_running() -> None:
    """A registry nobody stopped (a script that raised, a fixture that never finished) ends with
    this interpreter rather than outlive it. Not a forked child's: the registries are its parent's."""
    for starter, registry in _registries:
        if starter == os.getpid():
            registry.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m devtools.schemaregistry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8081, help="0 picks a free port (default 8081)")
    args = parser.parse_args(argv)
    registry = start_registry(args.port)
    print(registry.url, flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stops it as Ctrl-C does
    try:
        registry.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        registry.stop()


if __name__ == "__main__":
    main()
