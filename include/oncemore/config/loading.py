"""Pipeline files read into the model (model.py): YAML, ``${ENV}`` substitution, the pipelines
directory, relative certificate and key paths made absolute against the file (core/clientfiles.py),
and pydantic's complaints turned into one line per problem that names the file and the key, in a
YAML writer's words.

Invariant: a value never appears in an error (it may be a substituted secret).
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from oncemore.config.model import Pipeline
from oncemore.config.values import ConfigError, option_text
from oncemore.core.clientfiles import resolve_relative
from oncemore.core.storage import table_key
from oncemore.core.suggest import closest

PIPELINES_DIR_ENV = "ONCEMORE_PIPELINES_DIR"
DEFAULT_PIPELINES_DIR = Path(__file__).resolve().parents[2] / "pipelines"

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")

def pipelines_dir() -> Path:
    return Path(os.environ.get(PIPELINES_DIR_ENV) or DEFAULT_PIPELINES_DIR)


def known_pipeline_names() -> list[str]:
    """The names of the pipeline files in the pipelines directory (not loaded)."""
    return sorted(p.stem for p in pipelines_dir().glob("*.y*ml"))


def load_named(name: str) -> Pipeline:
    """Pipeline ``name``: its YAML file in the pipelines directory."""
    return _directory_pipeline(resolve_config_path(name))


def resolve_config_path(name: str) -> Path:
    """The YAML file of pipeline ``name`` in the pipelines directory."""
    directory = pipelines_dir()
    for suffix in (".yaml", ".yml"):
        candidate = directory / f"{name}{suffix}"
        if candidate.is_file():
            return candidate
    raise ConfigError(str(directory), "", f"no pipeline named {name!r} (known: {', '.join(known_pipeline_names()) or 'none'})")


def load_pipeline(path: str | Path, environ: Mapping[str, str] | None = None) -> Pipeline:
    """The pipeline of a YAML file, named anything (``--config``; in the pipelines directory a
    file is named after its pipeline, which is how a name finds it)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read: {exc.strerror or exc}") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, "", f"not valid YAML: {_yaml_problem(exc)}") from None
    return parse_pipeline(raw, source, os.environ if environ is None else environ, path.resolve().parent)


def _directory_pipeline(path: Path) -> Pipeline:
    pipeline = load_pipeline(path)
    if pipeline.name != path.stem:
        raise ConfigError(str(path), "name", f"must match the file name {path.stem!r} in the pipelines directory, got "
                                             f"{pipeline.name!r}")
    return pipeline


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Where and what, never the text around it: the line may hold a secret."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    context = getattr(exc, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{context + ': ' if context else ''}{problem}"


def load_all(directory: Path | None = None) -> tuple[list[Pipeline], dict[str, ConfigError]]:
    """Every pipeline in ``directory``; broken files are returned apart so the others still load.
    Pipelines that share a table are all broken: a table belongs to one pipeline."""
    loaded, broken = [], {}
    for path in sorted((directory or pipelines_dir()).glob("*.y*ml")):
        try:
            loaded.append(_directory_pipeline(path))
        except ConfigError as exc:
            broken[str(path)] = exc
        except Exception as exc:  # a bug of ours must not take every other pipeline's DAG down
            broken[str(path)] = ConfigError(str(path), "", f"cannot be loaded ({type(exc).__name__})")
    broken.update(shared_tables(loaded))
    return [p for p in loaded if p.origin not in broken], broken


def broken_line(path: str, problem: ConfigError) -> str:
    """A file of the directory that does not load (``load_all``'s ``broken``), as one line."""
    return f"broken: {problem}" if str(problem).startswith(path) else f"broken: {path}: {problem}"


def shared_tables(pipelines: list[Pipeline]) -> dict[str, ConfigError]:
    """By file, the pipelines whose main (or route) or quarantine table is also another pipeline's
    table, with the error naming the other: two pipelines planning into one table would duplicate records."""
    owners: dict[str, list[tuple[Pipeline, str]]] = {}
    for pipeline in pipelines:
        tables = [(t.setting, t.table_uri) for t in pipeline.tables] + [("sink.quarantine_uri", pipeline.sink.quarantine_uri)]
        for key, uri in tables:
            owners.setdefault(table_key(uri), []).append((pipeline, key))
    errors: dict[str, ConfigError] = {}
    for users in owners.values():
        for pipeline, key in users:
            others = [f"{other.name} ({other.origin}, {other_key})" for other, other_key in users if other is not pipeline]
            if others and pipeline.origin not in errors:
                errors[pipeline.origin] = ConfigError(pipeline.origin, key, f"is also the table of pipeline {', '.join(others)}; "
                                                                     "a table belongs to one pipeline")
    return errors


def substitute_env(value: Any, source: str, environ: Mapping[str, str], path: str = "") -> Any:
    """Replaces ``${VAR}`` and ``${VAR:-default}`` in every string of the document."""
    if isinstance(value, dict):
        return {k: substitute_env(v, source, environ, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_env(v, source, environ, f"{path}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(source, path, f"environment variable {name} is not set")

    return _ENV_REF.sub(replace, value)


def parse_pipeline(raw: Any, source: str, environ: Mapping[str, str], base: Path | None = None) -> Pipeline:
    """A validated pipeline from a parsed YAML document; ConfigError names the first problem.
    Relative certificate and key paths are resolved against ``base`` (the file's directory)."""
    if not isinstance(raw, dict):
        raise ConfigError(source, "", f"must be a mapping, got {type(raw).__name__}")
    document = substitute_env(raw, source, environ)
    if base is not None:
        document = _files_resolved(document, base)
    try:
        pipeline = Pipeline.model_validate(document)
    except ValidationError as exc:
        problems = [_problem(e) for e in exc.errors(include_url=False)]
        # A misspelt key also leaves the right one missing: the unknown key says what happened.
        meant = {suggested for _, _, suggested in problems if suggested}
        found = sorted(((k, p) for k, p, _ in problems if not (k in meant and p == "is required")),
                       key=lambda kp: not kp[1].startswith("unknown"))
        found = list(dict.fromkeys(found))  # a union's members may each report the same problem
        raise ConfigError(source, *found[0], more=found[1:]) from None
    pipeline._origin = source
    return pipeline


def _files_resolved(document: dict, base: Path) -> dict:
    """The document with the relative paths of its client options (Kafka's, each registry's) made
    absolute against ``base``: a Spark executor opens them too, in another working directory."""
    blocks = [("source", "kafka_options"), ("format", "schema_registry"), ("key", "schema_registry")]
    document = dict(document)
    for block, options in blocks:
        if isinstance(document.get(block), dict) and isinstance(document[block].get(options), dict):
            document[block] = {**document[block], options: resolve_relative(document[block][options], base)}
    routes = document.get("routes")
    if isinstance(routes, dict) and isinstance(routes.get("tables"), dict):
        document["routes"] = {**routes, "tables": {
            value: _files_resolved(route, base) if isinstance(route, dict) else route
            for value, route in routes["tables"].items()}}
    return document


# What a YAML value is, for "got ..." (never the value itself: it may be a substituted secret).
_YAML_KINDS = {str: "a string", int: "a number", float: "a number", bool: "true/false", list: "a list",
               dict: "a mapping", type(None): "nothing (null)"}
# Pydantic's wording, in a YAML writer's words.
_PLAIN_WORDS = [(r"^Value error, ", ""), (r"^Input should be ", "must be "), (r"^String should ", "should "),
                (r"a valid (tuple|list)", "a list"), (r"a valid dictionary( or instance of \w+)?", "a mapping"),
                (r"a valid string", "a string"), (r"a valid integer(, unable to parse string as an integer)?", "an integer"),
                (r"a valid boolean(, unable to interpret input)?", "true or false"), (r"a valid number", "a number")]


def _problem(error: Mapping[str, Any]) -> tuple[str, str, str | None]:
    """Pydantic's error as (dotted key, problem, the key it was probably meant as). The problem
    never quotes the input; a type error names the YAML kind given."""
    loc = [str(part) for part in error["loc"] if not str(part).startswith("function-")]
    context = error.get("ctx") or {}
    if context.get("key"):
        loc.append(context["key"])
    # Pydantic names the member of a union it tried (transform.PythonTransform.python): not a key.
    members = {m.__name__ for m in _nested_models(Pipeline)}
    keys = [p for p in loc if p not in members | {"str", "int", "float", "bool"}]
    key, meant = ".".join(keys), None
    if error["type"] == "missing":
        problem = "is required"
    elif error["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        close = closest(keys[-1], allowed)
        if close:
            meant = ".".join([*keys[:-1], close])
            problem = f"unknown key; did you mean {meant}?"
        else:
            problem = f"unknown key (allowed: {', '.join(allowed)})"
    else:
        problem = error["msg"]
        for pattern, plain in _PLAIN_WORDS:
            problem = re.sub(pattern, plain, problem)
        if error["type"].endswith("_type") and "input" in error:
            problem += f", got {_YAML_KINDS.get(type(error['input']), type(error['input']).__name__)}"
    return key, problem, meant


def _allowed_keys(loc: list[str]) -> list[str]:
    """The keys of the model at ``loc`` (optional blocks, lists of blocks and unions included)."""
    model: type[BaseModel] = Pipeline
    for part in loc:
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is not None:
            model = _model_of(field.annotation) or model
        # Otherwise a list index or the member of a union pydantic names (e.g. PythonTransform).
        elif any(m.__name__ == part for m in _nested_models(Pipeline)):
            model = next(m for m in _nested_models(Pipeline) if m.__name__ == part)
    return sorted(field.alias or name for name, field in model.model_fields.items())


def _models_in(model: type[BaseModel]) -> list[type[BaseModel]]:
    return [m for f in model.model_fields.values() for m in _all_models(f.annotation)]


def _nested_models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """``model`` and every model its fields hold, at any depth."""
    found = {model}
    for inner in _models_in(model):
        if inner not in found:
            found |= _nested_models(inner)
    return found


def _all_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _all_models(arg)]


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds (``Maintenance | None`` -> Maintenance), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_of, typing.get_args(annotation)) if m is not None), None)


def with_kafka_overrides(pipeline: Pipeline, overrides: Mapping[str, Any]) -> Pipeline:
    """The pipeline with ``bootstrap_servers`` and ``kafka_options`` taken from ``overrides`` (an
    Airflow connection, or ``run --kafka-overrides-file`` for a Spark job it launches)."""
    unknown = set(overrides) - {"bootstrap_servers", "kafka_options"}
    if unknown:
        raise ConfigError("Kafka overrides", sorted(unknown)[0], "unknown key (allowed: bootstrap_servers, kafka_options)")
    source = pipeline.source.model_copy(update={
        "bootstrap_servers": overrides.get("bootstrap_servers") or pipeline.source.bootstrap_servers,
        "kafka_options": {**pipeline.source.kafka_options,
                          **{k: option_text(v) for k, v in overrides.get("kafka_options", {}).items()}},
    })
    return pipeline.model_copy(update={"source": source})  # keeps the origin (a private attribute)
