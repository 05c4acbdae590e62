"""The package's shape: its stages import only the stages below them (pyproject.toml's import-layers
contract, checked by import-linter), the top level stays small, no module grows past 400 lines,
every ``__init__.py`` is a docstring alone, the dev servers stay out of the shipped package, a
worker decoding JSON never imports the registry client, and the processes that plan or run a
sink's write never import delta-rs."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "include" / "oncemore"
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"


def test_no_stage_imports_a_later_stage_and_the_core_imports_nothing_of_oncemore():
    done = subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "include")})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_the_contract_names_every_stage_of_the_package():
    import tomllib

    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    stages = {f"oncemore.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    modules = {f"oncemore.{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert set(contract["layers"]) == stages | modules


def test_the_top_level_holds_at_most_twelve_modules_and_no_module_passes_400_lines():
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 12, top
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_every_init_is_a_docstring_alone():
    for init in PACKAGE.rglob("__init__.py"):
        body = ast.parse(init.read_text()).body
        statements = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if init.parent == PACKAGE:  # the package's version, a constant
            statements = [s for s in statements if not (isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant))]
        assert statements == [], f"{init.relative_to(PACKAGE)} does more than name its stage"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.relative_to(PACKAGE)} says nothing of its stage"


def test_the_shipped_package_holds_no_dev_server():
    import zipfile

    from oncemore.run.session import package_zip

    names = zipfile.ZipFile(package_zip()).namelist()
    assert names and all(n.startswith("oncemore/") for n in names), names
    assert not [n for n in names if "devtools" in n or "/dev" in n]


def test_a_worker_decoding_json_never_imports_the_registry_client():
    probe = """
import sys
import pyarrow as pa
from oncemore.decode.recordspec import FormatSpec, RecordSpec
from oncemore.run.taskspec import TaskSpec
spec = TaskSpec.single(RecordSpec(FormatSpec("json", ddl="id BIGINT"), None, False), pa.schema([("id", pa.int64())]),
                       "/t", "/q", (), {})
decoded = spec.decoder().decode(pa.table({
    "key": pa.array([None], pa.binary()), "value": pa.array([b'{"id": 7}']), "topic": ["t"],
    "partition": pa.array([0], pa.int32()), "offset": pa.array([0], pa.int64()),
    "timestamp": pa.array([0], pa.timestamp("us", tz="UTC")), "timestampType": pa.array([0], pa.int32()),
    "headers": pa.nulls(1, pa.list_(pa.field("element", pa.struct([("key", pa.string()), ("value", pa.binary())])))),
    "timestamp_ms": pa.array([0], pa.int64())}))
assert decoded.good.column("id").to_pylist() == [7], decoded
print(sorted(n for n in sys.modules if "schema_registry" in n or n.startswith("oncemore.decode.registry")))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "include")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_sinks_writing_tasks_never_import_delta_rs():
    """Spark imports run/deltasink.py in each writing task (its function's pickle names it); the
    commit, which needs delta-rs and the MERGE (commit/part.py, ~40 MiB a process), runs in the
    run's own process."""
    probe = ("import sys; from oncemore.run import deltasink; "
             "print(sorted(n for n in sys.modules if n.split('.')[0] == 'deltalake' or n == 'oncemore.commit.part'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "include")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
