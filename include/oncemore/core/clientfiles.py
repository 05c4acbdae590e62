"""Client options that name local files (certificates, keys, CA bundles): relative paths in a
pipeline file resolved against that file, and each file checked readable where a client is made.

A Kafka client (and the registry client) opens these files itself, where it runs: on the driver
and again on every executor. A path relative to the working directory is found on one and missed
on the other, and librdkafka reports a file it cannot open as an OpenSSL error naming neither
option nor file. So a pipeline file's relative paths become absolute when it loads, and a client
is made only after its files were opened here, naming option, path and host when one cannot be,
and librdkafka's failure to load one (a wrong key passphrase, a file that is not PEM) is said with
its option and path (``refused_file``).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Mapping

# librdkafka's (and the schema registry client's) settings whose value is a local path.
FILE_OPTIONS = ("ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.keystore.location",
                "ssl.crl.location")
# ssl.ca.location may instead ask librdkafka to find the system's CA certificates.
_NOT_PATHS = {"probe"}


def resolve_relative(options: Mapping[str, object], base: Path) -> dict[str, object]:
    """``options`` with each relative file option made absolute against ``base`` (``~`` expanded)."""
    resolved = dict(options)
    for key in FILE_OPTIONS:
        value = options.get(key)
        if isinstance(value, str) and value and value not in _NOT_PATHS:
            path = Path(value).expanduser()
            resolved[key] = str(path if path.is_absolute() else (base / path).resolve())
    return resolved


def unreadable(options: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(option, path, why) of the first file option this process cannot open; None when all open.
    A directory is a CA directory (librdkafka's CApath) and counts as readable when it can be listed."""
    for key in FILE_OPTIONS:
        path = options.get(key)
        if not path or path in _NOT_PATHS:
            continue
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb"):
                    pass
        except OSError as exc:
            return key, path, f"{exc.strerror or exc} (on host {socket.gethostname()})"
    return None


def refused_file(config: Mapping, message: str) -> tuple[str, str | None, str] | None:
    """(option, its path or None for an inline PEM, why) when librdkafka's ``message`` says it
    could not load a setting's file (``ssl.key.location failed: error:0A080009:SSL routines::PEM
    lib``); its OpenSSL reason is kept, the passphrase never named but by its option."""
    found = re.search(r"\b(ssl\.[a-z.]+) failed: (.+)$", message)
    if found is None:
        return None
    option, reason = found.groups()
    if option in ("ssl.key.location", "ssl.key.pem"):
        if "key values mismatch" in reason:
            why = "the key does not belong to the certificate of ssl.certificate.location"
        elif config.get("ssl.key.password"):
            why = "the passphrase in ssl.key.password does not decrypt it, or it is not a PEM private key"
        else:
            why = "it is encrypted and no ssl.key.password is set, or it is not a PEM private key"
    elif option == "ssl.keystore.location":
        why = "the password in ssl.keystore.password does not open it, or it is not a PKCS#12 keystore"
    else:
        why = "it holds no PEM certificate librdkafka can read"
    path = config.get(option) if option.endswith(".location") else None
    return option, path, f"{why} (librdkafka: {reason})"
