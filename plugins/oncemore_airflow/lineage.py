"""OpenLineage of the ingest task: the Kafka topics in, the main (or each route's) and quarantine Delta
tables out, and what the run committed, as the OpenLineage provider asks an operator for it (``OperatorLineage``).

Datasets are named by OpenLineage's naming spec through openlineage-python's helpers: a topic as
``kafka://host:port`` (the first bootstrap server, without a listener prefix or credentials) and
its name; a table by its location (``file`` and its absolute path, ``s3://bucket`` and its key,
``gs://``, ``abfss://``). Each table carries its schema, storage (delta, parquet) and version
facets as the run left it, its catalog name (``symlinks``) once the run registered it in
``sink.catalog``, and output statistics (rows, bytes, files) only when a commit of this
run added to it: a no-op carries none. The run facet ``oncemore`` carries each partition's
committed [start, end) and the versions the run made (a routed pipeline's by route).

Invariant: lineage follows the commits and never gates them. Its facts are read in the task's own
process after the run (the Delta log at the versions the run made; the run's report for what it
added), so the provider's forked emitter only serializes them; a failure to read them is a
warning naming pipeline and run, the event then goes without them, and nothing is lost: the
table's log keeps every range, count and version of the run's commits (``oncemore status``, the
report task).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import boto3
from attrs import define
from deltalake.schema import ArrayType, MapType, StructType
from openlineage.client.event_v2 import InputDataset, OutputDataset
from openlineage.client.facet_v2 import (
    RunFacet,
    dataset_version_dataset,
    output_statistics_output_dataset,
    schema_dataset,
    storage_dataset,
    symlinks_dataset,
)
from openlineage.client.naming import dataset as naming

from oncemore.catalog.glue import CLIENT_CONFIG
from oncemore.config.catalog import QUARANTINE_SUFFIX, Catalog, catalog_name
from oncemore.config.model import Pipeline
from oncemore.core.columns import QUARANTINE_TAG, ROUTE_TAG_PREFIX
from oncemore.core.coordinates import nested
from oncemore.core.storage import table_location
from oncemore.plan.ledger import open_table
from oncemore.plan.planner import Plan
from oncemore.run.runreport import RunReport

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

KAFKA_DEFAULT_PORT = "9092"


@define
class OncemoreRunFacet(RunFacet):
    """What an oncemore run committed: per partition the [start, end) its commits moved the
    positions over (``committed``, {topic: {partition: [start, end]}}), per batch the same with its
    versions and records, and the versions of the tables the outputs describe (a routed
    pipeline's: ``routeTableVersions`` by route, and no main table)."""

    pipeline: str
    runId: str  # noqa: N815 (OpenLineage's field names are camelCase)
    status: str  # committed | no-op | dry-run
    committed: dict
    batches: list
    tableVersion: int | None  # noqa: N815
    quarantineTableVersion: int | None  # noqa: N815
    routeTableVersions: dict | None = None  # noqa: N815


@dataclass(frozen=True)
class TableState:
    """A table as lineage describes it: its version and schema (None: no table there yet)."""

    version: int | None
    fields: tuple = ()  # schema_dataset.SchemaDatasetFacetFields


def kafka_namespace(bootstrap_servers: str) -> tuple[str, str]:
    """(host, port) of the first bootstrap server, as OpenLineage names a Kafka cluster: a listener
    prefix (``SASL_SSL://``) and anything before an ``@`` are not part of it."""
    first = bootstrap_servers.split(",")[0].strip().rpartition("://")[2].rpartition("@")[2]
    host, colon, port = first.rpartition(":")
    if not colon or host.count(":") and not host.endswith("]"):  # no port, or a bare IPv6 address
        return first, KAFKA_DEFAULT_PORT
    return host, port


def topic_dataset(bootstrap_servers: str, topic: str) -> naming.Kafka:
    return naming.Kafka(*kafka_namespace(bootstrap_servers), topic)


def table_dataset(table_uri: str) -> tuple[str, str]:
    """A Delta table's dataset (namespace, name): its location by the naming spec's scheme."""
    location = table_location(table_uri)
    parts = urlsplit(location)
    path = parts.path.lstrip("/")
    if "://" not in location or parts.scheme == "file":
        name = naming.LocalFileSystem(parts.path if parts.scheme == "file" else location)
    elif parts.scheme in ("s3", "s3a"):
        name = naming.S3(parts.netloc, path)
    elif parts.scheme == "gs":
        name = naming.GCS(parts.netloc, path)
    elif parts.scheme == "abfss":
        container, _, account = parts.netloc.partition("@")
        name = naming.ABFSS(container, account.split(".")[0], path)
    else:  # the spec's general rule: the scheme and authority, then the path
        return f"{parts.scheme}://{parts.netloc}", parts.path
    return name.get_namespace(), name.get_name()


def table_state(table_uri: str, storage_options: dict[str, str] | None, version: int | None) -> TableState:
    """The table at ``version`` (its newest when None), from its Delta log."""
    table = open_table(table_location(table_uri), storage_options)
    if table is None:
        return TableState(None)
    if version is not None and version != table.version():  # a later commit is another run's
        table.load_as_version(version)
    return TableState(table.version(), tuple(_field(f.name, f.type) for f in table.schema().fields))


def _field(name: str, kind) -> schema_dataset.SchemaDatasetFacetFields:
    """A Delta schema field as the schema facet nests it (an array's element is ``_element``, a
    map's ``key`` and ``value``)."""
    if isinstance(kind, StructType):
        return schema_dataset.SchemaDatasetFacetFields(name, "struct", fields=[_field(f.name, f.type) for f in kind.fields])
    if isinstance(kind, ArrayType):
        return schema_dataset.SchemaDatasetFacetFields(name, "array", fields=[_field("_element", kind.element_type)])
    if isinstance(kind, MapType):
        return schema_dataset.SchemaDatasetFacetFields(
            name, "map", fields=[_field("key", kind.key_type), _field("value", kind.value_type)])
    return schema_dataset.SchemaDatasetFacetFields(name, kind.type)


def tables(pipeline: Pipeline) -> dict[str, str]:
    """The tables the ingest task writes, by role: "main" (or each route's, "route:<value>") and "quarantine"."""
    return {**{t.tag: t.table_uri for t in pipeline.tables}, QUARANTINE_TAG: pipeline.sink.quarantine_uri}


def catalog_symlinks(catalog: Catalog, routes=()) -> dict[str, symlinks_dataset.Identifier]:
    """By table (of a routed pipeline, each of its ``routes``' instead of the main one), the name
    ``sink.catalog`` registers it under (catalog/registration.py), as
    OpenLineage names it: Hive ``hive://host:port`` and ``database.table``; Glue
    ``arn:aws:glue:region:account`` and ``table/database/table``, the region and account those of
    AWS's environment, as Glue's client finds them (one call to STS)."""
    if catalog.type == "hive":
        address = urlsplit(catalog.uri)
        named = partial(naming.Hive, address.hostname, str(address.port), catalog.database)
    else:
        session = boto3.session.Session(region_name=os.environ.get("AWS_REGION") or None)
        account = session.client("sts", config=CLIENT_CONFIG).get_caller_identity()["Account"]
        named = partial(naming.AWSGlue, session.region_name, account, catalog.database)
    names = [(ROUTE_TAG_PREFIX + route, named(catalog_name(catalog.table, route))) for route in routes] or [
        ("main", named(catalog.table))]
    names.append((QUARANTINE_TAG, named(catalog.table + QUARANTINE_SUFFIX)))
    return {role: symlinks_dataset.Identifier(name.get_namespace(), name.get_name(), "TABLE") for role, name in names}


def input_datasets(pipeline: Pipeline, topics) -> list[InputDataset]:
    return [InputDataset(d.get_namespace(), d.get_name())
            for d in (topic_dataset(pipeline.source.bootstrap_servers, t) for t in topics)]


def output_datasets(pipeline: Pipeline, states: dict[str, TableState] | None = None,
                    added: dict[str, dict[str, int]] | None = None,
                    registered: dict[str, symlinks_dataset.Identifier] | None = None) -> list[OutputDataset]:
    """The main (or each route's) and the quarantine table; with ``states``, their facets, and the catalog name of
    each that exists, when the tables are ``registered``; with what the run ``added`` to a table,
    its output statistics."""
    outputs = []
    for role, uri in tables(pipeline).items():
        namespace, name = table_dataset(uri)
        state = (states or {}).get(role)
        facets = {}
        if state is not None and state.version is not None:
            facets = {"schema": schema_dataset.SchemaDatasetFacet(fields=list(state.fields)),
                      "storage": storage_dataset.StorageDatasetFacet(storageLayer="delta", fileFormat="parquet"),
                      "version": dataset_version_dataset.DatasetVersionDatasetFacet(datasetVersion=str(state.version))}
            if role in (registered or {}):
                facets["symlinks"] = symlinks_dataset.SymlinksDatasetFacet(identifiers=[registered[role]])
        statistics = (added or {}).get(role)
        output_facets = {} if statistics is None else {
            "outputStatistics": output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
                rowCount=statistics.get("rows"), size=statistics.get("bytes"), fileCount=statistics.get("files"))}
        outputs.append(OutputDataset(namespace, name, facets=facets, outputFacets=output_facets))
    return outputs


def start_lineage(pipeline: Pipeline) -> OperatorLineage:
    """Before the run: the topics the config names (a pattern's are known once planned) and the tables."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    return OperatorLineage(inputs=input_datasets(pipeline, pipeline.source.topic_names or ()),
                           outputs=output_datasets(pipeline))


def run_lineage(pipeline: Pipeline, plan: Plan, run_id: str, report: RunReport | None,
                dry_run: bool = False) -> OperatorLineage:
    """After the run (``report``; None when the task skipped an empty plan or a dry run): the
    plan's topics, the tables at the versions the run made (or found), what it added, and the
    ``oncemore`` run facet."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    made = report.committed_versions if report is not None else {}
    storage = dict(pipeline.sink.storage_options)
    states = {role: table_state(uri, storage, made.get(role)) for role, uri in tables(pipeline).items()}
    batches = [b for b in report.batches if b.status == "committed"] if report is not None else []
    facet = OncemoreRunFacet(
        pipeline=pipeline.name, runId=run_id,
        status="dry-run" if dry_run else report.status if report is not None else "no-op",
        committed=_ranges(report.committed if report is not None else {}),
        batches=[{"seq": b.seq, "committed": _ranges(b.committed), "versions": b.versions,
                  "quarantineVersions": b.quarantine_versions, "written": b.written, "quarantined": b.quarantined,
                  **({"tableVersions": {tag.removeprefix(ROUTE_TAG_PREFIX): v for tag, v in b.table_versions.items()},
                      "unrouted": b.unrouted} if pipeline.routes is not None else {})}
                 for b in batches],
        tableVersion=states["main"].version if "main" in states else None,
        quarantineTableVersion=states[QUARANTINE_TAG].version,
        routeTableVersions=None if pipeline.routes is None else {
            role.removeprefix(ROUTE_TAG_PREFIX): state.version for role, state in states.items() if role != QUARANTINE_TAG})
    added = report.added if report is not None else {}
    # A run that returned registered the tables that exist (a failed registration fails the run).
    registered = (catalog_symlinks(pipeline.sink.catalog, pipeline.routes.tables if pipeline.routes else ())
                  if report is not None and pipeline.sink.catalog else {})
    return OperatorLineage(inputs=input_datasets(pipeline, plan.topics),
                           outputs=output_datasets(pipeline, states, added, registered), run_facets={"oncemore": facet})


def _ranges(ranges) -> dict[str, dict[str, list[int]]]:
    return nested({key: list(pair) for key, pair in ranges.items()})


def lineage_enabled() -> bool:
    """Whether the OpenLineage provider emits at all (a transport is configured): the facts are
    read only then."""
    from airflow.providers.openlineage import conf

    return not conf.is_disabled()
