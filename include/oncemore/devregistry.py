"""A small Confluent-compatible Schema Registry for the tests and the demo, over HTTP, so that every
process (Spark's Python workers, CLI subprocesses) reaches the same registry; confluent-kafka's
``mock://`` registry lives inside one process only. No registry server is installable here
(shared/PLATFORM.md); real deployments use Confluent's Schema Registry (the compose file's), which
this one imitates for the REST subset confluent-kafka 2.16.1's client and serializers use:

- ``POST /subjects/{s}/versions`` registers (idempotent: the same schema, type and references get
  the existing ID, in any subject, as in Confluent's) and answers ``{"id": n}``;
  ``POST /subjects/{s}`` looks a schema up; ``GET /subjects``, ``/subjects/{s}/versions``,
  ``/subjects/{s}/versions/{v|latest}``; ``GET /schemas/ids/{id}`` (with ``schemaType`` when not
  AVRO and ``references``), ``/schemas/ids/{id}/subjects|versions``, ``/schemas/types``;
  ``GET /config[/{s}]`` (always NONE) and ``PUT /config[/{s}]`` (NONE only).
- Schemas are kept as registered, in memory. Protobuf schemas are taken as confluent-kafka's
  ProtobufSerializer registers them, a base64 FileDescriptorProto, and served so whatever the
  ``format`` asked (Confluent's registry turns them into .proto text unless ``format=serialized``;
  there is no .proto compiler here, so .proto text is refused at registration).
- No compatibility checks: every new schema becomes the subject's next version.
- With ``--require-auth`` every request needs HTTP basic credentials equal to
  ``$ONCEMORE_DEVREGISTRY_USER_INFO`` (``user:password``; from the environment, not the command line,
  so ``ps`` does not show them).

Run: ``python -m oncemore.devregistry --port 0`` prints ``http://127.0.0.1:PORT`` once listening;
SIGTERM stops it. ``start_registry()`` does that in a subprocess and returns a ``DevRegistry``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from .devprocess import stop_process

USER_INFO_ENV = "ONCEMORE_DEVREGISTRY_USER_INFO"
SCHEMA_TYPES = ("AVRO", "JSON", "PROTOBUF")


class RegistryFailure(Exception):
    """An answer other than 200, in Confluent's error body: ``{"error_code": ..., "message": ...}``."""

    def __init__(self, status: int, error_code: int, message: str):
        super().__init__(message)
        self.status, self.error_code = status, error_code


@dataclass(frozen=True)
class _Stored:
    id: int
    schema: str
    schema_type: str
    references: tuple[tuple[str, str, int], ...]  # (name, subject, version)

    def body(self) -> dict:
        answer: dict = {"schema": self.schema}
        if self.schema_type != "AVRO":  # Confluent's registry leaves AVRO implicit
            answer["schemaType"] = self.schema_type
        if self.references:
            answer["references"] = [{"name": n, "subject": s, "version": v} for n, s, v in self.references]
        return answer


class SchemaStore:
    """Subjects, versions and schema IDs in memory; every method is atomic."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_id: dict[int, _Stored] = {}
        self._by_identity: dict[tuple, int] = {}
        self._subjects: dict[str, list[int]] = {}  # subject -> schema ID of each version, in order

    def register(self, subject: str, request: dict) -> int:
        schema_type, text, references = self._parse(request)
        with self._lock:
            self._check(schema_type, text, references)
            identity = (schema_type, _canonical(schema_type, text), references)
            schema_id = self._by_identity.get(identity)
            if schema_id is None:
                schema_id = self._by_identity[identity] = len(self._by_id) + 1
                self._by_id[schema_id] = _Stored(schema_id, text, schema_type, references)
            versions = self._subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            return schema_id

    def lookup(self, subject: str, request: dict) -> dict:
        schema_type, text, references = self._parse(request)
        with self._lock:
            versions = self._subject(subject)
            schema_id = self._by_identity.get((schema_type, _canonical(schema_type, text), references))
            if schema_id not in versions:
                raise RegistryFailure(404, 40403, "Schema not found")
            return self._version_body(subject, versions.index(schema_id) + 1)

    def subjects(self) -> list[str]:
        with self._lock:
            return sorted(self._subjects)

    def versions(self, subject: str) -> list[int]:
        with self._lock:
            return list(range(1, len(self._subject(subject)) + 1))

    def version(self, subject: str, version: str) -> dict:
        with self._lock:
            count = len(self._subject(subject))
            if version in ("latest", "-1"):
                number = count
            elif version.isdigit() and 1 <= int(version):
                number = int(version)
            else:
                raise RegistryFailure(422, 42202, f"The specified version '{version}' is not a valid version id.")
            if number > count:
                raise RegistryFailure(404, 40402, f"Version {version} not found.")
            return self._version_body(subject, number)

    def schema(self, schema_id: int) -> dict:
        with self._lock:
            return self._stored(schema_id).body()

    def schema_versions(self, schema_id: int) -> list[dict]:
        with self._lock:
            self._stored(schema_id)
            return [{"subject": s, "version": ids.index(schema_id) + 1}
                    for s, ids in sorted(self._subjects.items()) if schema_id in ids]

    def _subject(self, subject: str) -> list[int]:
        if subject not in self._subjects:
            raise RegistryFailure(404, 40401, f"Subject '{subject}' not found.")
        return self._subjects[subject]

    def _stored(self, schema_id: int) -> _Stored:
        if schema_id not in self._by_id:
            raise RegistryFailure(404, 40403, "Schema not found")
        return self._by_id[schema_id]

    def _version_body(self, subject: str, number: int) -> dict:
        stored = self._by_id[self._subjects[subject][number - 1]]
        return {"subject": subject, "version": number, "id": stored.id, **stored.body()}

    @staticmethod
    def _parse(request: dict) -> tuple[str, str, tuple[tuple[str, str, int], ...]]:
        schema_type = request.get("schemaType") or "AVRO"
        text = request.get("schema")
        if schema_type not in SCHEMA_TYPES:
            raise RegistryFailure(422, 42201, f"Invalid schema type {schema_type!r}")
        if not isinstance(text, str) or not text:
            raise RegistryFailure(422, 42201, "Invalid schema: no schema text")
        try:
            references = tuple((r["name"], r["subject"], int(r["version"])) for r in request.get("references") or [])
        except (KeyError, TypeError, ValueError):
            raise RegistryFailure(422, 42201, "Invalid schema: a reference needs name, subject and version") from None
        return schema_type, text, references

    def _check(self, schema_type: str, text: str, references: tuple) -> None:
        """Refuses what a client could not read back; called with the lock held."""
        for name, subject, version in references:
            versions = self._subjects.get(subject, [])
            if not 1 <= version <= len(versions):
                raise RegistryFailure(422, 42201, f"Invalid schema: reference {name!r} names {subject!r} "
                                                  f"version {version}, which is not registered")
        if schema_type == "PROTOBUF":
            from google.protobuf import descriptor_pb2
            from google.protobuf.message import DecodeError

            try:
                descriptor_pb2.FileDescriptorProto.FromString(base64.b64decode(text, validate=True))
            except (binascii.Error, ValueError, DecodeError):
                raise RegistryFailure(422, 42201, "Invalid schema: this development registry takes Protobuf "
                                                  "schemas as a base64 FileDescriptorProto (as confluent-kafka's "
                                                  "ProtobufSerializer registers them), not .proto text") from None
        elif schema_type == "AVRO":
            self._check_avro(text, references)
        else:
            _json(text)

    def _check_avro(self, text: str, references: tuple) -> None:
        import fastavro

        named: dict = {}
        try:
            for _name, subject, version in references:
                fastavro.parse_schema(_json(self._by_id[self._subjects[subject][version - 1]].schema), named)
            fastavro.parse_schema(_json(text), named)
        except RegistryFailure:
            raise
        except Exception as exc:
            raise RegistryFailure(422, 42201, f"Invalid schema: {exc}") from None


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RegistryFailure(422, 42201, f"Invalid schema: not JSON ({exc})") from None


def _canonical(schema_type: str, text: str) -> str:
    """The text two registrations of the same schema share (JSON without its layout)."""
    if schema_type == "PROTOBUF":
        return text
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server: "_Server"

    def do_GET(self):
        self._answer("GET")

    def do_POST(self):
        self._answer("POST")

    def do_PUT(self):
        self._answer("PUT")

    def do_DELETE(self):
        self._answer("DELETE")

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass  # quiet: tests read stdout for the URL and nothing else

    def _answer(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            self._authorize()
            status, answer = 200, self._route(method, body)
        except RegistryFailure as failure:
            status, answer = failure.status, {"error_code": failure.error_code, "message": str(failure)}
        content = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(content)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Basic realm="oncemore-devregistry"')
        self.end_headers()
        self.wfile.write(content)

    def _authorize(self) -> None:
        expected = self.server.user_info
        if expected is None:
            return
        given = self.headers.get("Authorization", "")
        wanted = "Basic " + base64.b64encode(expected.encode()).decode()
        if not hmac.compare_digest(given.encode(), wanted.encode()):
            raise RegistryFailure(401, 40101, "Unauthorized")

    def _route(self, method: str, body: bytes):
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [unquote(p) for p in url.path.strip("/").split("/") if p]
        store = self.server.store
        request = _json_body(body) if method in ("POST", "PUT") else {}
        match (method, parts):
            case ("GET", []):
                return {}
            case ("GET", ["subjects"]):
                prefix = query.get("subjectPrefix", "")
                return [s for s in store.subjects() if s.startswith(prefix)]
            case ("POST", ["subjects", subject, "versions"]):
                return {"id": store.register(subject, request)}
            case ("POST", ["subjects", subject]):
                return store.lookup(subject, request)
            case ("GET", ["subjects", subject, "versions"]):
                return store.versions(subject)
            case ("GET", ["subjects", subject, "versions", version]):
                return store.version(subject, version)
            case ("GET", ["schemas", "types"]):
                return list(SCHEMA_TYPES)
            case ("GET", ["schemas", "ids", schema_id]):
                return store.schema(_schema_id(schema_id))
            case ("GET", ["schemas", "ids", schema_id, "versions"]):
                return store.schema_versions(_schema_id(schema_id))
            case ("GET", ["schemas", "ids", schema_id, "subjects"]):
                return sorted({v["subject"] for v in store.schema_versions(_schema_id(schema_id))})
            case ("GET", ["config"] | ["config", _]):
                return {"compatibilityLevel": "NONE"}
            case ("PUT", ["config"] | ["config", _]):
                level = request.get("compatibility") or request.get("compatibilityLevel")
                if level != "NONE":
                    raise RegistryFailure(422, 42203, f"compatibility {level!r}: this development registry checks "
                                                      "no compatibility, so it only takes NONE")
                return {"compatibility": "NONE"}
        raise RegistryFailure(404 if method == "GET" else 405, 404 if method == "GET" else 405,
                              f"{method} {url.path} is not served by this development registry")


def _json_body(body: bytes) -> dict:
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        raise RegistryFailure(422, 422, "request body is not JSON") from None
    if not isinstance(request, dict):
        raise RegistryFailure(422, 422, "request body is not a JSON object")
    return request


def _schema_id(text: str) -> int:
    if not text.isdigit():
        raise RegistryFailure(404, 40403, "Schema not found")
    return int(text)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a client's idle keep-alive connection must not hold up shutdown

    def __init__(self, port: int, user_info: str | None):
        super().__init__(("127.0.0.1", port), _Handler)
        self.store, self.user_info = SchemaStore(), user_info


def serve(port: int, user_info: str | None = None) -> None:
    """Serves until SIGTERM or SIGINT; prints the URL once listening."""
    server = _Server(port, user_info)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class DevRegistry:
    """A development registry running in a subprocess of ours."""

    def __init__(self, url: str, process: subprocess.Popen, user_info: str | None = None):
        self.url, self.process, self.user_info = url, process, user_info

    def settings(self) -> dict[str, str]:
        """``schema_registry:`` settings for a pipeline against this registry (confluent-kafka's)."""
        return {"url": self.url, **({"basic.auth.user.info": self.user_info} if self.user_info else {})}

    def stop(self) -> None:
        stop_process(self.process)


def start_registry(port: int = 0, user_info: str | None = None) -> DevRegistry:
    """Starts ``python -m oncemore.devregistry`` on 127.0.0.1 (a free port unless given); with
    ``user_info`` ("user:password") it requires those basic credentials."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (package_parent, os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "oncemore.devregistry", "--port", str(port)]
    if user_info:
        environment[USER_INFO_ENV] = user_info
        command.append("--require-auth")
    errors = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=environment)
    url = process.stdout.readline().strip()  # printed once it listens
    if not url:
        process.wait(10)
        errors.seek(0)
        raise RuntimeError(f"devregistry exited ({process.returncode}): {errors.read().strip()}")
    return DevRegistry(url, process, user_info)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oncemore.devregistry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8081, help="0 picks a free port (default 8081)")
    parser.add_argument("--require-auth", action="store_true",
                        help=f"require HTTP basic credentials equal to ${USER_INFO_ENV} (user:password)")
    args = parser.parse_args(argv)
    user_info = None
    if args.require_auth:
        user_info = os.environ.get(USER_INFO_ENV)
        if not user_info or ":" not in user_info:
            parser.error(f"--require-auth needs {USER_INFO_ENV}=user:password in the environment")
    serve(args.port, user_info)


if __name__ == "__main__":
    main()
