"""The way one pipeline's run goes through the package: which oncemore modules the driver's calls
enter on a small run through the CLI (JSON records, one batch, one part, local Spark), how many
calls cross from one module into another, and how often such a call comes back into a module the
run had entered before and left (a new call, not a return): the mark of a hub that hand-carries
everything instead of stages that hand their result on. Calls into the shared vocabulary (the core:
coordinates, errors, schemas, the stopwatch) and a module's own import are not counted.

    scripts/benchmark callpath [--code DIR] [--records 1000]

``--code DIR`` measures another checkout's ``include`` (e.g. the commit before a layout change) on
the same broker and records, so the figures of two layouts sit side by side. Only the driver's
main thread is traced (Spark's tasks run in their own processes); the figures are counts, not times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from devtools import kafkabroker

INCLUDE = Path(__file__).resolve().parents[1] / "include"
# The shared vocabulary every stage speaks (ids, errors, schemas, the stopwatch): calls into it are
# no hand-over between stages and are not counted. The flat layout's names of the same modules are
# listed so a checkout from before the stage folders (--code) is measured alike.
VOCABULARY_FLAT = ("coordinates", "errors", "schema", "ddl", "redaction", "faults", "storage", "profile")


def vocabulary(code: Path) -> list[str]:
    core = code / "oncemore" / "core"
    if core.is_dir():
        return [f"oncemore.core.{p.stem}" for p in core.glob("*.py")] + ["oncemore.core"]
    return [f"oncemore.{name}" for name in VOCABULARY_FLAT]

# Runs in the measured checkout's interpreter: the CLI's `run` under a profile hook that notes, for
# each call into an oncemore function, the oncemore module of the nearest oncemore caller.
TRACER = r"""
import inspect, json, sys

VOCABULARY = set(sys.argv[2].split(","))

def module_of(frame):
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if (name == "oncemore" or name.startswith("oncemore.")) and name not in VOCABULARY:
            return name
        frame = frame.f_back
    return None

moves, entered, runner = [], [], []

def hook(frame, event, arg):
    # A module's or a class body's code (not CO_OPTIMIZED) runs at its import: no call of the run's.
    if event != "call" or not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        return
    callee = frame.f_globals.get("__name__", "")
    if not (callee == "oncemore" or callee.startswith("oncemore.")) or callee in VOCABULARY:
        return
    caller = module_of(frame.f_back)
    if caller is not None and caller != callee:
        moves.append((caller, callee))
        if caller == "oncemore.cli" and frame.f_code.co_name == "run":
            runner.append(callee)
    if callee not in entered:
        entered.append(callee)

from oncemore.cli import main
sys.setprofile(hook)
try:
    code = main(["run", "--config", sys.argv[1]])
finally:
    sys.setprofile(None)
comebacks, per_move = 0, {}
seen = {moves[0][0]} if moves else set()
for caller, callee in moves:
    if callee in seen:
        comebacks += 1
        per_move[f"{caller} -> {callee}"] = per_move.get(f"{caller} -> {callee}", 0) + 1
    seen.add(callee)
hub = {}
for caller, callee in moves:
    if runner and caller == runner[0]:
        hub[callee] = hub.get(callee, 0) + 1
print(json.dumps({"code": code, "modules": entered, "moves": len(moves), "comebacks": comebacks,
                  "per_move": per_move, "runner": runner[0] if runner else None, "hub": hub}))
"""


def measure(code: Path, config: Path) -> dict:
    environment = {**os.environ, "PYTHONPATH": str(code), "ONCEMORE_SPARK_MASTER": "local[1]"}
    done = subprocess.run([sys.executable, "-c", TRACER, str(config), ",".join(vocabulary(code))], env=environment, capture_output=True,
                          text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"the traced run failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if figures["code"] != 0:
        sys.exit(f"oncemore run exited {figures['code']}:\n{done.stderr[-3000:]}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, action="append", default=[],
                        help="another checkout's include directory (repeatable); this checkout's is measured too")
    parser.add_argument("--records", type=int, default=1000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oncemore-callpath-"))
    with kafkabroker.running(kafkabroker.start_kafka()) as broker:
        results = {}
        for index, code in enumerate([INCLUDE, *args.code]):
            topic = f"callpath_{index}"
            broker.create_topic(topic, partitions=2)
            broker.produce(topic, [(i % 2, None, json.dumps({"id": i, "customer": f"c{i}"}).encode(), None)
                                   for i in range(args.records)])
            config = work / f"{topic}.yaml"
            config.write_text(yaml.safe_dump({
                "name": topic, "source": {"bootstrap_servers": broker.bootstrap_servers, "topic": topic},
                "sink": {"table_uri": str(work / "delta" / topic), "quarantine_uri": str(work / "delta" / f"{topic}_q")},
                "format": {"type": "json", "schema": "id BIGINT, customer STRING"},
            }))
            results[str(code)] = measure(code.resolve(), config)
    for code, figures in results.items():
        print(f"{code}: {len(figures['modules'])} modules entered, {figures['moves']} calls between modules, "
              f"{figures['comebacks']} of them back into a module left before")
        print(f"  the run's own module ({figures['runner']}) calls into {len(figures['hub'])} modules, "
              f"{sum(figures['hub'].values())} calls: " + ", ".join(
                  f"{name.replace('oncemore.', '')} {count}" for name, count in sorted(figures["hub"].items())))
        busiest = sorted(figures["per_move"].items(), key=lambda item: -item[1])[:10]
        print("  the calls that come back most: " + ", ".join(
            f"{name.replace('oncemore.', '')} {count}" for name, count in busiest))
        print("  in order of first entry: " + " ".join(name.removeprefix("oncemore.") for name in figures["modules"]))


if __name__ == "__main__":
    main()
