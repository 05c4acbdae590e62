"""Which Spark Connect session a run uses: one that this host keeps on the server and reuses, held
by one run at a time.

A new session gets Python workers of its own on the server: its first job took 4 to 7 s here, a
job in a reused session 0.5 s. So a run takes a *slot*: the first of this host's slots for the
server whose lock it gets (``flock``, released when the process ends, however it ends), and the
session id the slot stands for. Invariants:
- one run at a time per session: a transform's temp view ``records`` and the session's settings
  are never shared by two runs at once;
- another host, another server, another version of the package, another user or another cache
  directory (the locks' own namespace: two containers may share a host name) never meets the
  session: its id is derived from all of them (the package's artifact is added once per session,
  under the same name);
- a session the server closed (its idle timeout, ``spark.connect.session.manager.
  defaultSessionTimeout``, 60 min by default, or a release) refuses its id for good: the slot
  moves to a new random generation, kept in the slot's file (a counter could meet ids the server
  closed before a cache was wiped; a random one also keeps the id from being guessed).
What a run leaves in the session stays for the next run of any pipeline of this host: the
settings oncemore sets are set again by every run; a Python transform that changes session
settings or registers views changes them for the runs after it.

Lives in ``$XDG_CACHE_HOME/oncemore/connect`` (``~/.cache``). Without a usable directory, or with
a ``session_id`` in the URL (the user's own session), the run opens a session as given.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import os
import secrets
import socket
import uuid
from pathlib import Path
from typing import IO

# Slots per host and server: as many runs of this host at once reuse sessions; more get new ones.
SLOTS = 16
_NAMESPACE = uuid.UUID("6f1c3a52-0d4e-4a36-9b1e-6b0c2f1e9a71")


class Slot:
    """One held slot: its session id (a UUID) and the lock that keeps it this process's."""

    def __init__(self, handle: IO[str], key: str, index: int):
        self.handle, self.key, self.index = handle, key, index

    @property
    def generation(self) -> int:
        self.handle.seek(0)
        text = self.handle.read().strip()
        return int(text) if text.isdigit() else 0

    @property
    def session_id(self) -> str:
        return str(uuid.uuid5(_NAMESPACE, f"{self.key}/{self.index}/{self.generation}"))

    def renew(self) -> None:
        """The server closed this slot's session: the slot stands for a new one from now on."""
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(str(secrets.randbits(62)))
        self.handle.flush()

    def release(self) -> None:
        self.handle.close()  # closing the file drops its lock


def take_slot(address: str, package: bytes) -> Slot | None:
    """The first free slot of this host for the server at ``address`` and this ``package``'s
    content, locked for this process; None when all are held or the cache cannot be used."""
    try:
        base = slots_dir().resolve()
        key = hashlib.sha256("\0".join([socket.getfqdn(), _user(), str(base), address,
                                        hashlib.sha256(package).hexdigest()]).encode()).hexdigest()[:32]
        directory = base / key
        directory.mkdir(parents=True, exist_ok=True)
        for index in range(SLOTS):
            handle = open(directory / f"{index}.slot", "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as refused:
                handle.close()
                if isinstance(refused, BlockingIOError):
                    continue  # another run holds it
                raise
            slot = Slot(handle, key, index)
            if not slot.generation:  # a new slot: a random generation, so its session id cannot be guessed
                slot.renew()
            return slot
    except (OSError, RuntimeError):  # no usable cache directory (read-only, no home, no locks)
        return None
    return None


def slots_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oncemore" / "connect"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's)
        return str(os.getuid())
