"""What a small run costs end to end, through the CLI as a user runs it: a cold run on a fresh JVM
(`local[*]`), the no-op rerun, the cost of each further batch of a run, and the same small run on
a warm Spark Connect server (devtools.sparkconnect) — the resident Spark of hourly pipelines —
right after another run and after a pause that outlasts the server's idle Python workers.

    scripts/benchmark fixed-cost [--records 100] [--batches 6] [--code DIR]

``--code DIR`` runs the CLI of another checkout's ``include`` (e.g. an older commit, for a
before/after table; its Connect figures are skipped when it has no ``--remote``, its phases when
it has no ``--profile``). Figures, not verdicts: the issue's targets are printed beside them, and
where the time of the cold and the warm run went (``oncemore run --profile``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from devtools import kafkabroker
from devtools.sparkconnect import start_connect_server

INCLUDE = Path(__file__).resolve().parents[1] / "include"


def write_pipeline(directory: Path, name: str, broker, topic: str, per_commit: int) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic},
        "sink": {"table_uri": str(directory / "delta" / name), "quarantine_uri": str(directory / "delta" / f"{name}_q")},
        "format": {"type": "json", "schema": "id BIGINT, customer STRING, amount DOUBLE"},
        "limits": {"max_records_per_commit": per_commit},
    }))
    return path


PROFILES: dict[str, str] = {}  # what -> the run's --profile table


CACHE = Path(tempfile.gettempdir(), f"oncemore-fixed-cache-{os.getpid()}")  # the JVM's class archive: none at first


def cli_run(code: Path, config: Path, *extra: str, env: dict | None = None, profile_as: str | None = None) -> float:
    """Seconds from process start to exit of `oncemore run`, as a user waits for it."""
    environment = {**os.environ, "PYTHONPATH": str(code), "ONCEMORE_SPARK_MASTER": "local[*]",
                   "XDG_CACHE_HOME": str(CACHE), **(env or {})}
    if profile_as and "--profile" in (code / "oncemore" / "cli.py").read_text():
        extra += ("--profile",)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "oncemore.cli", "run", "--config", str(config), *extra],
                          env=environment, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"oncemore run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    if "--profile" in extra:
        PROFILES[profile_as] = "\n".join(done.stdout.splitlines()[1:])
    return seconds


def settle_class_archive() -> None:
    """Waits for the JVM writing the class archive to exit and marks the archive settled, so the
    next run adopts it (a user's next run does after 30 s)."""
    deadline = time.monotonic() + 120
    while subprocess.run(["pgrep", "-f", f"ArchiveClassesAtExit={CACHE}"], capture_output=True).returncode == 0:
        if time.monotonic() > deadline:
            sys.exit("the JVM writing the class archive did not exit")
        time.sleep(0.5)
    for written in CACHE.rglob("*.writing"):
        os.utime(written, (time.time() - 3600,) * 2)


def produce(broker, topic: str, start: int, count: int) -> None:
    broker.produce(topic, [(i % 3, None, json.dumps({"id": i, "customer": f"c{i % 97}", "amount": i * 1.25}).encode(),
                            None) for i in range(start, start + count)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--code", type=Path, default=INCLUDE, help="the include/ directory whose CLI runs")
    args = parser.parse_args()
    n, batches, code = args.records, args.batches, args.code.resolve()
    work = Path(tempfile.mkdtemp(prefix="oncemore-fixed-"))
    rows = []
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        for topic in ("first", "small", "batches", "remote"):
            broker.create_topic(topic, 3)
        for topic in ("first", "small"):
            produce(broker, topic, 0, n)
        produce(broker, "batches", 0, n * batches)

        first = cli_run(code, write_pipeline(work, "first", broker, "first", n))
        rows.append(("cold run, the machine's first (JVM archives)", f"{n} records", first, ""))
        settle_class_archive()
        cold = cli_run(code, write_pipeline(work, "small", broker, "small", n), profile_as="cold run")
        rows.append(("cold run, local[*], JVM start included", f"{n} records", cold, "<= 12 s"))
        rows.append(("no-op rerun", "0 records", cli_run(code, work / "small.yaml"), "< 1 s"))
        many = cli_run(code, write_pipeline(work, "batches", broker, "batches", n))
        rows.append((f"cold run of {batches} batches", f"{n * batches} records", many, ""))
        rows.append(("each further batch of a run", f"{n} records", (many - cold) / (batches - 1), "<= 2 s"))

        has_remote = "--remote" in (code / "oncemore" / "cli.py").read_text()
        if has_remote:
            server = start_connect_server("local[2]")
            try:
                remote = {"SPARK_REMOTE": server.url}
                produce(broker, "remote", 0, n)
                warmup = cli_run(code, write_pipeline(work, "remote", broker, "remote", n), env=remote)
                rows.append(("first run on a fresh Connect server", f"{n} records", warmup, ""))
                produce(broker, "remote", n, n)
                warm = cli_run(code, work / "remote.yaml", env=remote, profile_as="warm Connect run")
                rows.append(("run on a warm Connect server", f"{n} records", warm, "<= 3 s"))
                # Spark stops a Python worker idle for a minute: an hourly run finds none left.
                # The median of three, as one such run varied by 0.4 s.
                idle = []
                for step in range(3):
                    time.sleep(75)
                    produce(broker, "remote", (2 + step) * n, n)
                    idle.append(cli_run(code, work / "remote.yaml", env=remote,
                                        profile_as="Connect run after 75 s idle" if step == 2 else None))
                rows.append(("the same after 75 s idle, median of 3", f"{n} records", statistics.median(idle), "<= 3 s"))
                rows.append(("no-op rerun, Connect configured", "0 records",
                             cli_run(code, work / "remote.yaml", env=remote), "< 1 s"))
            finally:
                server.stop()
    shutil.rmtree(CACHE, ignore_errors=True)
    print(f"\nfixed cost per run ({code}), {os.cpu_count()} cores:")
    print(f"  {'what':<44} {'size':>13} {'seconds':>8}  target")
    for what, size, seconds, target in rows:
        print(f"  {what:<44} {size:>13} {seconds:8.1f}  {target}")
    for what, table in PROFILES.items():
        print(f"\nwhere the {what}'s time went (oncemore run --profile; process start to exit is more):")
        print("\n".join(f"  {line}" for line in table.splitlines()))


if __name__ == "__main__":
    main()
