"""The local servers' processes: stopping those the demo and the tests start (kafkabroker,
schemaregistry, s3server, sparkcluster) politely (SIGTERM, so a broker with a data directory
flushes it), then surely, so no test leaves a process behind; and running one of them detached, for
a developer's own topics and schemas (scripts/kafka, scripts/registry: ``serve_main``).

A detached server outlives the command that started it (a session of its own, no terminal, its
output in a file) and keeps its data and a pid file in one data directory. The pid file names it
only while a process of that pid runs with the data directory on its command line, so a stale file
(a crash, a reboot, a reused pid) never makes ``stop`` signal another process.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

import psutil

PID_FILE = "server.pid"  # in the data directory


def stop_process(process: subprocess.Popen, grace_seconds: float = 10) -> None:
    process.terminate()
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def default_data_dir(name: str) -> Path:
    """Where a detached server keeps its data unless told otherwise:
    ``${XDG_DATA_HOME:-~/.local/share}/oncemore/<name>``."""
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "oncemore" / name


def launch_detached(command: list[str], data_dir: Path, output: Path) -> subprocess.Popen:
    """Starts ``command`` in ``data_dir`` in a session of its own (no terminal's hangup or Ctrl-C
    reaches it), its stdin closed and its output appended to ``output``, so it holds none of the
    caller's pipes; returns the process."""
    with output.open("a") as out:
        return subprocess.Popen(command, cwd=data_dir, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def serving(process: subprocess.Popen, wait_ready: Callable[[subprocess.Popen], None]) -> subprocess.Popen:
    """``process`` once ``wait_ready(process)`` returns; killed and reaped if it raises (a server
    that never came up leaves no process behind)."""
    try:
        wait_ready(process)
    except BaseException:
        process.kill()
        process.wait(30)
        raise
    return process


def start_detached(command: list[str], data_dir: Path, output: Path,
                   wait_ready: Callable[[subprocess.Popen], None]) -> int:
    """Launches ``command`` detached (``launch_detached``) and, once it serves, records its pid in
    ``data_dir``; returns the pid."""
    process = serving(launch_detached(command, data_dir, output), wait_ready)
    (data_dir / PID_FILE).write_text(f"{process.pid}\n")
    return process.pid


def running_pid(data_dir: Path) -> int | None:
    """The pid of the server running on ``data_dir``, or None (a stale pid file is removed)."""
    pid_file = data_dir / PID_FILE
    try:
        pid = int(pid_file.read_text())
        process = psutil.Process(pid)
        if process.status() != psutil.STATUS_ZOMBIE and any(str(data_dir) in a for a in process.cmdline()):
            return pid
    except (FileNotFoundError, ValueError, psutil.NoSuchProcess, psutil.AccessDenied):
        pass
    pid_file.unlink(missing_ok=True)
    return None


def stop_detached(data_dir: Path, grace_seconds: float = 60) -> int | None:
    """Stops the server running on ``data_dir`` (SIGTERM, then SIGKILL after ``grace_seconds``)
    and returns its pid once it has exited, or None when none ran."""
    pid = running_pid(data_dir)
    if pid is None:
        return None
    process = psutil.Process(pid)
    process.terminate()
    try:
        process.wait(grace_seconds)
    except psutil.TimeoutExpired:
        process.kill()
        process.wait(10)
    (data_dir / PID_FILE).unlink(missing_ok=True)
    return pid


def port_taken(port: int) -> bool:
    """Whether a process listens on 127.0.0.1:``port``. As the servers bind it (SO_REUSEADDR): the
    connections a stopped server leaves in TIME_WAIT do not hold its port."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def serve_main(argv: list[str] | None, *, prog: str, what: str, name: str, default_port: int,
               start: Callable[[Path, int], int], address: Callable[[Path], tuple[int, str]],
               parents: Sequence[argparse.ArgumentParser] = ()) -> int:
    """The command line of a detached server: ``start [--port] [--data-dir]``, ``stop``, ``status``.

    ``start(data_dir, port)`` starts ``what`` and returns its pid once it serves; ``address(data_dir)``
    is the port and the address the one of ``data_dir`` serves on; ``parents`` add options the
    caller has read already (their parsers, for the help). Exit codes: 0 done (or already
    so), 1 failed (or running on another port than asked), 3 ``status`` of a server not running (as
    LSB init scripts say it)."""
    parser = argparse.ArgumentParser(prog=prog, description=f"Runs {what} in the background for your own use.",
                                     parents=list(parents))
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--port", type=int, default=default_port,
                        help=f"start: the port on 127.0.0.1 to serve on (default {default_port})")
    parser.add_argument("--data-dir", type=Path, default=default_data_dir(name),
                        help=f"its data, log and pid file, kept between starts (default {default_data_dir(name)})")
    args = parser.parse_args(argv)
    data_dir = args.data_dir.expanduser().resolve()
    stop = f"{prog} stop" + ("" if data_dir == default_data_dir(name) else f" --data-dir {data_dir}")
    pid = running_pid(data_dir)
    if args.command == "status":
        if pid is None:
            print(f"{what} is not running (data in {data_dir})")
            return 3
        print(f"{what} is running at {address(data_dir)[1]} (pid {pid}, data in {data_dir})")
        return 0
    if args.command == "stop":
        if pid is None:
            print(f"{what} is not running (data in {data_dir})")
        else:
            stop_detached(data_dir)
            print(f"{what} stopped (pid {pid}); its data stays in {data_dir}")
        return 0
    if pid is not None:
        port, serving = address(data_dir)
        print(f"{what} is already running at {serving} (pid {pid}, data in {data_dir})")
        if port != args.port:  # the caller would talk to the wrong address
            print(f"{prog}: it serves on port {port}, not {args.port}: `{stop}` first to move it",
                  file=sys.stderr)
            return 1
        return 0
    if port_taken(args.port):
        print(f"{prog}: port {args.port} of 127.0.0.1 is taken by another process: stop it, or start on another "
              "port with --port", file=sys.stderr)
        return 1
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        pid = start(data_dir, args.port)
    except (RuntimeError, FileNotFoundError, ValueError) as failure:
        print(f"{prog}: {what} did not start: {failure}", file=sys.stderr)
        return 1
    print(f"{what} is running at {address(data_dir)[1]} (pid {pid}); data and log in {data_dir}; "
          f"`{stop}` stops it")
    return 0
