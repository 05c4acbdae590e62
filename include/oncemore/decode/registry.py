"""The schema registry as oncemore's decoders see it: schemas by ID (the writer of each record) and
a subject's latest version (the table's schema), from a Confluent-compatible registry.

A pipeline's ``schema_registry:`` settings are confluent-kafka ``SchemaRegistryClient`` settings
as they are (``url``, ``basic.auth.user.info``, ``ssl.ca.location``, ...). A ``Registry`` holds only
those settings, so it pickles to Spark's Python workers; each process builds one client per
settings and keeps it, and that client keeps every schema it fetched by ID (IDs are immutable), so
an executor asks the registry once per schema, not once per record. ``latest`` always asks.

Invariant: a failure is a ``RegistryError`` naming the registry URL without user info, the subject
or schema ID, and the cause with every configured secret masked; ``SchemaNotFound`` (HTTP 404)
is the one failure a decoder may blame on a record (an unknown schema ID); any other (registry
down, refused credentials) fails the task, since quarantining records for it would be wrong.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple
from urllib.parse import urlsplit

from oncemore.core.errors import OncemoreError
from oncemore.core.redaction import REDACTED, is_harmless, redact

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

# httpx waits forever without a timeout: a registry that accepts a connection and never answers
# would stall a run (and `oncemore check`). A pipeline's schema_registry.timeout overrides it.
REQUEST_TIMEOUT_SECONDS = 30.0
# The client's settings it wants as numbers; a pipeline file's options arrive as text.
_NUMBERS = ("timeout", "cache.capacity", "cache.latest.ttl.sec", "max.retries", "retries.wait.ms", "retries.max.wait.ms")


class RegistryError(OncemoreError):
    """The registry could not answer (evidence: ``url`` without user info, ``subject`` or
    ``schema_id``, ``status`` when it answered over HTTP)."""


class SchemaNotFound(RegistryError):
    """The registry answered 404: no such schema ID, subject or version."""


class SchemaReference(NamedTuple):
    """A schema's reference to a subject's version, by the name the schema imports it under."""

    name: str
    subject: str
    version: int


@dataclass(frozen=True)
class RegistrySchema:
    """A schema as the registry serves it: its text (Protobuf's a base64 FileDescriptorProto when
    asked ``fmt="serialized"``), its type, its references, and the ID it is registered under (None
    for one the registry never served: a merge). oncemore's own value rather than confluent-kafka's
    ``Schema``, whose package loads the HTTP client and its OAuth libraries (23 MiB a process): a
    Python worker given its reader schema reads that ID's records without them, and imports the
    client only to ask the registry for another schema.

    The ID is part of the value so that it can never outlive its text: a decoder takes the records
    of ``id`` as written with this schema."""

    schema_str: str
    schema_type: str = "AVRO"
    references: tuple[SchemaReference, ...] = ()
    id: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RegistrySchema":
        """The registry's JSON form (``schema``, ``schemaType``, ``references``) and ``id``, as
        ``FormatSpec`` keeps it."""
        return cls(data["schema"], data.get("schemaType") or "AVRO",
                   tuple(SchemaReference(r["name"], r["subject"], int(r["version"])) for r in data.get("references") or ()),
                   data.get("id"))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": self.schema_str, "schemaType": self.schema_type,
                "references": [r._asdict() for r in self.references], "id": self.id}

    @classmethod
    def served(cls, schema: Any, schema_id: int) -> "RegistrySchema":
        """confluent-kafka's ``Schema`` as the registry served it under ``schema_id``."""
        return cls.from_dict({**schema.to_dict(), "id": schema_id})


class Registered(NamedTuple):
    """One version of a subject: its version number, and the schema (with its global ID)."""

    version: int
    schema: RegistrySchema


_clients: dict[str, SchemaRegistryClient] = {}
_clients_lock = threading.Lock()


class Registry:
    """A schema registry from a pipeline's ``schema_registry:`` settings (picklable: settings only)."""

    def __init__(self, settings: Mapping[str, Any]):
        self.settings = {"timeout": REQUEST_TIMEOUT_SECONDS, **settings}
        for key in _NUMBERS:
            if isinstance(self.settings.get(key), str):
                try:
                    self.settings[key] = float(self.settings[key]) if "." in self.settings[key] else int(self.settings[key])
                except ValueError:
                    raise RegistryError(f"schema registry: setting {key} must be a number", key=key) from None
        # The settings' url may list several registries, comma-separated (the client tries each).
        self._urls = [u.strip() for u in str(self.settings.get("url", "")).split(",")]
        self.url = ",".join(str(redact("registry", {"url": u})["url"]) for u in self._urls)

    def schema(self, schema_id: int, fmt: str | None = None) -> RegistrySchema:
        """The schema registered under ``schema_id``; ``fmt="serialized"`` asks for Protobuf
        schemas as a base64 FileDescriptorProto. Cached for the life of the process."""
        client = self._client()
        try:
            return RegistrySchema.served(client.get_schema(schema_id, fmt=fmt), schema_id)
        except Exception as exc:
            raise self._error(exc, f"schema ID {schema_id}", schema_id=schema_id) from None

    def version(self, subject: str, version: int, fmt: str | None = None) -> Registered:
        """A subject's version (how schema references are named). Cached like schemas by ID."""
        client = self._client()
        try:
            found = client.get_version(subject, version, deleted=True, fmt=fmt)
        except Exception as exc:
            raise self._error(exc, f"subject {subject!r} version {version}", subject=subject) from None
        return Registered(found.version, RegistrySchema.served(found.schema, found.schema_id))

    def latest(self, subject: str, fmt: str | None = None) -> Registered:
        """The subject's latest version, asked anew each time (a producer may register one during a run)."""
        client = self._client()
        try:
            # get_version("latest") skips the client's cache; get_latest_version would keep the
            # first answer for the life of the process unless cache.latest.ttl.sec is set.
            found = client.get_version(subject, "latest", fmt=fmt)
        except Exception as exc:
            raise self._error(exc, f"subject {subject!r}", subject=subject) from None
        return Registered(found.version, RegistrySchema.served(found.schema, found.schema_id))

    def _client(self) -> SchemaRegistryClient:
        from confluent_kafka.schema_registry import SchemaRegistryClient  # only where the registry is asked

        key = json.dumps(self.settings, sort_keys=True, default=str)
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                try:
                    client = _clients[key] = SchemaRegistryClient(dict(self.settings))
                except Exception as exc:
                    raise self._error(exc, "its settings") from None
            return client

    def _error(self, exc: Exception, what: str, **evidence: Any) -> RegistryError:
        from confluent_kafka.schema_registry.error import SchemaRegistryError  # loaded already, by _client

        status = exc.http_status_code if isinstance(exc, SchemaRegistryError) else None
        if isinstance(exc, SchemaRegistryError):
            cause = f"HTTP {status} (error code {exc.error_code}): {exc.error_message}"
        else:
            cause = f"{type(exc).__name__}: {exc}"
        kind = SchemaNotFound if status == 404 else RegistryError
        return kind(f"schema registry {self.url}: {what}: {self._mask(cause)}", url=self.url, status=status, **evidence)

    def _mask(self, text: str) -> str:
        """``text`` with every value of a setting that may be secret, and the URL's user info, masked."""
        secrets = [str(v) for k, v in self.settings.items() if not is_harmless("registry", k) and v]
        secrets += [s.partition(":")[2] for s in secrets]  # the password of a user:password pair alone
        secrets += [urlsplit(u).password or "" for u in self._urls]
        for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
            text = text.replace(secret, REDACTED)
        return text

    def __repr__(self) -> str:
        return f"Registry({redact('registry', self.settings)!r})"
