"""Which option values may be shown: an allow-list of known harmless keys, everything else masked.

librdkafka, delta-rs's object stores and the schema registry client each accept credentials
under many names (``sasl.password``, ``AZURE_STORAGE_ACCOUNT_KEY``, ``GOOGLE_SERVICE_ACCOUNT_KEY``,
``basic.auth.user.info``, ...) and gain new ones with every release; a pattern of secret-looking
names always misses one. So a value is shown only when its key is on the list below, and the
same rule drives Spark's redaction of the data source options that carry these settings to the
executors (``kafka.<key>``, ``storage.<KEY>``, ``registry.<key>``). A harmless key missing from
the list costs a masked value in a log, never a leaked secret.
"""

from __future__ import annotations

import re
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"

# librdkafka settings (CONFIGURATION.md) that name no credential.
HARMLESS_KAFKA_KEYS = frozenset({
    "allow.auto.create.topics", "api.version.fallback.ms", "api.version.request", "api.version.request.timeout.ms",
    "auto.commit.interval.ms", "auto.offset.reset", "broker.address.family", "broker.address.ttl",
    "broker.version.fallback", "check.crcs", "client.dns.lookup", "client.id", "client.rack",
    "connections.max.idle.ms", "coordinator.query.interval.ms", "debug", "enable.auto.commit",
    "enable.auto.offset.store", "enable.partition.eof", "enable.ssl.certificate.verification",
    "fetch.error.backoff.ms", "fetch.max.bytes", "fetch.message.max.bytes", "fetch.min.bytes",
    "fetch.queue.backoff.ms", "fetch.wait.max.ms", "group.id", "group.instance.id", "group.protocol",
    "heartbeat.interval.ms", "isolation.level", "log.connection.close", "log.queue", "log.thread.name",
    "log_level", "max.in.flight", "max.in.flight.requests.per.connection", "max.poll.interval.ms",
    "message.max.bytes", "metadata.max.age.ms", "metadata.recovery.strategy", "partition.assignment.strategy",
    "queued.max.messages.kbytes", "queued.min.messages", "receive.message.max.bytes", "reconnect.backoff.max.ms",
    "reconnect.backoff.ms", "request.timeout.ms", "retry.backoff.max.ms", "retry.backoff.ms", "sasl.kerberos.kinit.cmd",
    "sasl.kerberos.min.time.before.relogin", "sasl.kerberos.principal", "sasl.kerberos.service.name",
    "sasl.mechanism", "sasl.mechanisms", "sasl.oauthbearer.client.id", "sasl.oauthbearer.method",
    "sasl.oauthbearer.scope", "sasl.oauthbearer.token.endpoint.url", "sasl.username", "security.protocol",
    "session.timeout.ms", "socket.connection.setup.timeout.ms", "socket.keepalive.enable", "socket.max.fails",
    "socket.nagle.disable", "socket.receive.buffer.bytes", "socket.send.buffer.bytes", "socket.timeout.ms",
    "ssl.ca.location", "ssl.certificate.location", "ssl.cipher.suites", "ssl.crl.location", "ssl.curves.list",
    "ssl.endpoint.identification.algorithm", "ssl.key.location", "ssl.keystore.location", "ssl.sigalgs.list",
    "statistics.interval.ms", "topic.metadata.propagation.max.ms", "topic.metadata.refresh.fast.interval.ms",
    "topic.metadata.refresh.interval.ms", "topic.metadata.refresh.sparse",
})

# delta-rs / object_store storage options (compared upper-case: both spellings are accepted).
HARMLESS_STORAGE_KEYS = frozenset({
    "ALLOW_HTTP", "ALLOW_INVALID_CERTIFICATES", "AWS_ALLOW_HTTP", "AWS_CHECKSUM_ALGORITHM", "AWS_CONDITIONAL_PUT",
    "AWS_COPY_IF_NOT_EXISTS", "AWS_DEFAULT_REGION", "AWS_EC2_METADATA_DISABLED", "AWS_ENDPOINT", "AWS_ENDPOINT_URL",
    "AWS_FORCE_CREDENTIAL_LOAD", "AWS_IMDSV1_FALLBACK", "AWS_METADATA_ENDPOINT", "AWS_PROFILE", "AWS_REGION",
    "AWS_S3_ALLOW_UNSAFE_RENAME", "AWS_S3_EXPRESS", "AWS_S3_LOCKING_PROVIDER", "AWS_SKIP_SIGNATURE",
    "AWS_UNSIGNED_PAYLOAD", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_USE_EMULATOR", "AZURE_USE_FABRIC_ENDPOINT", "CONDITIONAL_PUT", "CONNECT_TIMEOUT",
    "DELTA_DYNAMO_TABLE_NAME", "HTTP1_ONLY", "HTTP2_ONLY", "POOL_IDLE_TIMEOUT", "POOL_MAX_IDLE_PER_HOST",
    "TIMEOUT", "USER_AGENT",
})

# confluent-kafka SchemaRegistryClient settings; ``url`` is shown without its user info.
HARMLESS_REGISTRY_KEYS = frozenset({
    "basic.auth.credentials.source", "bearer.auth.credentials.source", "bearer.auth.identity.pool.id",
    "bearer.auth.issuer.endpoint.url", "bearer.auth.logical.cluster", "bearer.auth.scope", "cache.capacity",
    "cache.latest.ttl.sec", "max.retries", "retries.max.wait.ms", "retries.wait.ms", "ssl.ca.location",
    "ssl.certificate.location", "ssl.key.location", "timeout", "url",
})

_KIND_KEYS = {"kafka": HARMLESS_KAFKA_KEYS, "storage": HARMLESS_STORAGE_KEYS, "registry": HARMLESS_REGISTRY_KEYS}


def _normal(kind: str, key: str) -> str:
    return key.upper() if kind == "storage" else key.lower()


def is_harmless(kind: str, key: str) -> bool:
    """True when ``key`` of a ``kind`` ("kafka" | "storage" | "registry") option map names no secret."""
    return _normal(kind, key) in _KIND_KEYS[kind]


def redact(kind: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with every value whose key is not known harmless masked (and URLs without user info)."""
    return {key: (_without_userinfo(value) if _normal(kind, key) == "url" else value) if is_harmless(kind, key)
            else REDACTED for key, value in options.items()}


def _without_userinfo(url: Any) -> Any:
    parts = urlsplit(str(url))
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}{f':{parts.port}' if parts.port else ''}"))


def spark_options_regex() -> str:
    """Java regex for ``spark.sql.redaction.options.regex``: every ``kafka.``/``storage.``/``registry.``
    (and the key's ``key.registry.``) data source option not on the allow-lists (Spark masks the
    value of an option whose key it finds), and Spark's own default (``url``)."""
    alternatives = []
    for kind, keys in _KIND_KEYS.items():
        allowed = "|".join(re.escape(k) for k in sorted(keys - {"url"}))
        prefix = "(?:key\\.)?registry" if kind == "registry" else kind
        alternatives.append(f"^{prefix}\\.(?!(?:{allowed})$)")
    return "(?i)" + "|".join(alternatives) + "|url"


def spark_statement_regex() -> str:
    """Java regex for ``spark.sql.redaction.string.regex`` on a Spark Connect session: the text of
    a plan a Connect server shows in its UI and writes to its event log (the proto's text form,
    ``key: "kafka.sasl.password" value: "..."``) masks the value of every kafka./storage./registry.
    option, harmless ones too (the option regex does not reach that text)."""
    return r'(?<=key: "(?:kafka|storage|(?:key\.)?registry)\.[^"\n]{1,200}"\s{1,40}value: ")(?:[^"\\]|\\.)*'


# Spark's own settings and environment never carry oncemore's secrets (they travel as data source
# options); this only widens Spark's default for whatever else a deployment puts there.
SPARK_CONF_REGEX = r"(?i)secret|password|token|key|credential|auth|jaas|signature|session"
