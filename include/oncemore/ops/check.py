"""``oncemore check``: a preflight for people adding pipelines. After a pipeline's config loads, it
checks that the brokers answer, each topic exists (its partitions and topic ID), the principal may
read each topic and, with ``commit_consumer_group``, commit to the mirror's group, the table's
positions may be continued (the same checks a run makes before it plans: whose table it is, the
topics' identity, positions within the log), the schema registry has the subjects the formats
read, what the records become (the table's schema from them and from the transform, as Spark's
analysis says: columns a transform, an expectation or ``partition_by`` names that do not exist
are named here, not by the run), and each table location holds a table oncemore can write and
that takes that schema, or is a place where the first run can create one; with ``sink.catalog``, the
catalog answers and nothing there is in the way of the tables' names. One ``Check`` per line.

Invariant: it writes nothing anywhere. Kafka is asked for the whole cluster's metadata (a named
topic's Metadata request may auto-create it), DescribeTopics and ListOffsets, a fetch at the end of
one partition per topic (READ), and for the mirror an offset of a topic that does not exist
(Kafka refuses it, for the group first when the group is denied: nothing is stored; a cluster
that never had a consumer group creates its internal ``__consumer_offsets`` topic when the
fetch's consumer asks for its group's coordinator, as every librdkafka consumer does), the
registry for the subjects' latest schemas, storage for a table's log or the directory or bucket a table would go
in, the catalog for the tables and databases it holds: no table, directory, consumer group, topic or
catalog entry is created. Spark is started only for a pipeline
with a transform or expectations, and reads no record. Whether an object store takes writes can
only be learned by writing, so there the check says it was not tried. With ``sample``, the latest
records of each partition are read through the formats, transform and expectations (sample.py),
writing nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from oncemore.commit.groupmirror import check_group, group_id
from oncemore.commit.tablefeatures import check_writable
from oncemore.config.model import Pipeline
from oncemore.config.routes import DataTable
from oncemore.core.columns import QUARANTINE_SCHEMA
from oncemore.core.errors import OncemoreError, root_cause
from oncemore.core.storage import location_problem, table_location
from oncemore.decode.resolve import resolve
from oncemore.kafka import clients
from oncemore.plan.ledger import open_table
from oncemore.plan.tables import Ledgers


@dataclass(frozen=True)
class Check:
    subject: str  # the pipeline's name, or the file of a config that does not load
    what: str
    problem: str | None  # None: passed
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.problem is None

    def line(self) -> str:
        return f"{'ok    ' if self.ok else 'FAILED'} {self.subject}: {self.what}: {self.detail if self.ok else self.problem}"


def check_pipeline(pipeline: Pipeline, spark_factory: Callable[[], object], sample: int | None = None) -> list[Check]:
    """Every check of a loaded pipeline (module docstring), in order; a check that could not be
    asked because an earlier one failed is not listed. A check failing in a way nobody foresaw is
    a failed check too, never the end of the others. ``spark_factory()``: the session that
    analyses a transform (called only for a pipeline that has one, or expectations). ``sample``:
    read that many of each partition's latest offsets (sample.py) once every check above passed."""
    name = pipeline.name
    checks = [Check(name, "config", None, pipeline.origin)]
    topics = list(pipeline.source.topic_names or ())  # the configured ones (none for a pattern) until Kafka answers
    try:
        admin = clients.admin_client(pipeline)
        metadata = clients.cluster_metadata(admin, pipeline)
    except Exception as exc:  # KafkaSourceError; or librdkafka refusing a kafka_options setting
        checks.append(Check(name, "kafka", _cause(exc)))
    else:
        checks.append(Check(name, "kafka", None, f"{pipeline.source.bootstrap_servers} answers (cluster "
                                                 f"{metadata.cluster_id}, {len(metadata.brokers)} brokers)"))
        try:
            source = clients.describe_source(admin, pipeline)
        except Exception as exc:
            checks.append(Check(name, "topics", _cause(exc)))
        else:
            topics = sorted(source.identities)
            for topic in topics:
                count = sum(1 for p in source.partitions if p.topic == topic)
                topic_id = source.identities[topic].topic_id or "none (a broker before Kafka 2.8)"
                checks.append(Check(name, f"topic {topic}", None, f"{count} partitions, topic ID {topic_id}"))
            checks.append(_read(pipeline, admin, source))
            if pipeline.commit_consumer_group:
                checks.append(_mirror_group(pipeline, admin))
            checks.append(_positions(pipeline, admin, source))
    registry = _registry(pipeline, topics)
    checks += registry
    tables = table_checks(pipeline)
    if all(c.ok for c in registry + tables):
        tables[0:0] = [_records(pipeline, table, topics, spark_factory) for table in pipeline.tables]
    checks += tables
    if pipeline.sink.catalog is not None:
        checks.append(_catalog(pipeline))
    if sample is not None:
        from oncemore.ops.sample import sample_checks  # it builds on this module's Check

        checks += sample_checks(pipeline, sample, spark_factory) if all(c.ok for c in checks) else [
            Check(name, "sample", "not read: a check above failed")]
    airflow = pipeline.airflow
    checks.append(Check(name, "airflow", None, "no airflow block: no DAG (CLI only)" if airflow is None else
                        f"a DAG on {airflow.schedule} (UTC) from {airflow.start_date.isoformat()}"))
    return checks


def table_checks(pipeline: Pipeline) -> list[Check]:
    """The pipeline's tables (the main table, or each route's, and the quarantine table): each holds
    a table oncemore can write, or one can be created there."""
    return [_table(pipeline, _what(t), t.table_uri, t.partition_by) for t in pipeline.tables] + [
        _table(pipeline, "quarantine table", pipeline.sink.quarantine_uri, ())]


def _what(table: DataTable) -> str:
    return "table" if table.route is None else f"route {table.route} table"


def _registry(pipeline: Pipeline, topics: list[str]) -> list[Check]:
    blocks = [(b, t) for b, fmt, t in [*((("format" if t.route is None else f"routes.tables.{t.route}.format"), t.format, t)
                                        for t in pipeline.tables), ("key", pipeline.key, pipeline.tables[0])]
              if fmt is not None and fmt.schema_registry]
    if not blocks:
        return []
    what = "schema registry"
    if not topics:
        return [Check(pipeline.name, what, "not asked: no topic of the pipeline is known (see above)")]
    found = []
    try:
        for block, table in blocks:
            spec = resolve(pipeline, topics, table)
            found.append(f"{block} {(spec.key if block == 'key' else spec.value).type}")
    except Exception as exc:  # RegistryError, FormatError: both name the registry, subject and cause
        return [Check(pipeline.name, what, _cause(exc))]
    return [Check(pipeline.name, what, None, f"has the latest schema of each subject read ({', '.join(found)})")]


def _read(pipeline: Pipeline, admin, source: clients.SourceState) -> Check:
    """What Kafka's authorizer says to a fetch of each topic (READ, which a run's tasks need)."""
    try:
        clients.check_readable(pipeline, clients.log_bounds(admin, pipeline, source.partitions))
    except Exception as exc:  # KafkaAccessDenied names the topic and the right
        return Check(pipeline.name, "read", _cause(exc))
    return Check(pipeline.name, "read", None, f"a fetch of each topic is allowed ({', '.join(source.topics)})")


def _mirror_group(pipeline: Pipeline, admin) -> Check:
    """Whether Kafka would take the mirror's commits to its consumer group (commit_consumer_group)."""
    what = f"consumer group {group_id(pipeline)}"
    try:
        check_group(admin, pipeline)
    except Exception as exc:  # KafkaAccessDenied names the group and the right
        return Check(pipeline.name, what, _cause(exc))
    return Check(pipeline.name, what, None, "the mirror may commit to it")


def _positions(pipeline: Pipeline, admin, source: clients.SourceState) -> Check:
    """The checks a run makes before it plans (continuity.py), on the tables' positions now."""
    what = "positions"
    try:
        log = clients.log_bounds(admin, pipeline, source.partitions)
        positions = Ledgers(pipeline).checked_positions(source.identities, log)
    except Exception as exc:  # PlanError: another pipeline's table, a recreated topic, expired positions, ...
        return Check(pipeline.name, what, _cause(exc))
    held = sum(v is not None for v in positions.values())
    if not held:
        return Check(pipeline.name, what, None, f"none yet: the first run starts at "
                                                f"{pipeline.source.starting_offsets.describe()}")
    return Check(pipeline.name, what, None, f"{held} of {len(positions)} partitions hold one, each continues "
                                            "on its topic")


def _records(pipeline: Pipeline, table: DataTable, topics: list[str], spark_factory: Callable[[], object]) -> Check:
    """What the records become (with routes, each route's): the table's schema (the transform's, as
    Spark analyses it), its partition columns, and whether the existing table takes it
    (``sink.schema_evolution``)."""
    from oncemore.decode.resolve import registries

    what = "records" if table.route is None else f"route {table.route} records"
    try:
        from oncemore.run.prepare import table_schema  # no pyspark unless the pipeline shapes records in Spark

        schema = table_schema(pipeline, resolve(pipeline, topics, table), registries(pipeline), spark_factory, table)
        found = open_table(table_location(table.table_uri), pipeline.sink.storage_options)
        added = _evolution(pipeline, table, found, schema) if found is not None else []
    except Exception as exc:  # TransformRefused, SchemaChangeRefused, ...
        return Check(pipeline.name, what, _cause(exc))
    shaped = "after the transform" if pipeline.transform is not None else "decoded"
    gains = f"; the table gains {', '.join(added)} at the next run" if added else ""
    return Check(pipeline.name, what, None, f"{len(schema)} columns {shaped}{gains}")


def _evolution(pipeline: Pipeline, table: DataTable, found, schema) -> list[str]:
    """The columns ``table`` (its snapshot ``found``) gains for ``schema``; SchemaChangeRefused when it cannot take it."""
    import json

    from pyspark.sql.types import StructType

    from oncemore.commit.evolution import evolve, spark_schema

    where = f"pipeline {pipeline.name}: table {table.table_uri}"
    current = StructType.fromJson(json.loads(found.schema().to_json()))
    return evolve(current, spark_schema(schema), pipeline.sink.schema_evolution, where)[1]


def _table(pipeline: Pipeline, what: str, table_uri: str, partition_by: tuple[str, ...]) -> Check:
    options = pipeline.sink.storage_options
    problem = location_problem(table_uri, options)
    if problem:
        return Check(pipeline.name, what, f"{table_uri}: {problem}")
    try:
        table = open_table(table_location(table_uri), options)
    except Exception as exc:  # permissions, a broken log
        return Check(pipeline.name, what, f"{table_uri}: cannot be read: {_cause(exc)}")
    if table is not None:
        return _existing(pipeline, what, table_uri, table, partition_by)
    local = "://" not in table_location(table_uri)
    return Check(pipeline.name, what, None, f"{table_uri}: no table yet; the first run creates it" + (
        "" if local else " (whether the store takes writes shows then: checking would write)"))


def _existing(pipeline: Pipeline, what: str, table_uri: str, table, partition_by: tuple[str, ...]) -> Check:
    from oncemore.commit.tables import check_partitioning  # pyspark's types: only once there is a table

    try:
        check_writable(table, table_uri)
        check_partitioning(table, table_uri, partition_by)
    except Exception as exc:
        return Check(pipeline.name, what, _cause(exc))
    if what == "quarantine table":
        columns = set(table.schema().to_arrow().names)
        missing = [f.name for f in QUARANTINE_SCHEMA if f.name not in columns]
        if missing:
            return Check(pipeline.name, what, f"{table_uri} is not a quarantine table: it has no {', '.join(missing)}")
    return Check(pipeline.name, what, None, f"{table_uri}: a Delta table at version {table.version()} oncemore can write")


def _catalog(pipeline: Pipeline) -> Check:
    """The catalog answers, and holds no name or location in the way of the tables' registration
    (read only: registering is the run's)."""
    from oncemore.catalog.registration import catalog_state

    state = catalog_state(pipeline)
    if state["blocked"]:
        return Check(pipeline.name, "catalog", state["reason"])
    if state["registered"]:
        return Check(pipeline.name, "catalog", None, f"{state['catalog']}: {state['summary'].removeprefix('catalog: ')}")
    return Check(pipeline.name, "catalog", None, f"{state['catalog']} answers; {state['reason']}")


def _cause(exc: Exception) -> str:
    """One line: oncemore's own errors as they are, others as root_cause says them."""
    return str(exc) if isinstance(exc, (OncemoreError, clients.KafkaSourceError)) else root_cause(exc)
