"""Kafka's answers shared by pipelines read together (the oncemore page's index, ``oncemore status``
of every pipeline): one admin client per cluster identity (the bootstrap servers and every client
setting, security included), the cluster's metadata asked once, and the log bounds of every
partition the pipelines read asked in one ListOffsets pair per cluster (``prefetch``).

A hundred pipelines on one cluster cost one client and its first metadata request (about 44 ms
each), not a hundred. The identity is a digest of the settings: nothing here keeps a secret in a
key, logs or names one. Lookups live as long as one view or command: nothing is kept between
views, so a view never shows an older view's offsets. A failure still names the pipeline that
asked: a cluster whose metadata cannot be read fails each of its pipelines at once, naming each,
instead of waiting out the timeout a hundred times.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Iterable, Sequence

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from oncemore.core.coordinates import KafkaPartition
from oncemore.core.errors import OncemoreError
from oncemore.kafka import clients
from oncemore.kafka.clients import KafkaSourceError, PartitionBounds, SourceState

if TYPE_CHECKING:
    from oncemore.config.model import Pipeline


def cluster_identity(pipeline: Pipeline) -> str:
    """Pipelines whose clients would be configured alike share a client: a digest of their settings."""
    settings = json.dumps(pipeline.source.kafka_config(), sort_keys=True, default=str)
    return hashlib.sha256(settings.encode()).hexdigest()


class _Cluster:
    """One cluster identity's admin client and what it has answered in this view."""

    def __init__(self, pipeline: Pipeline):
        self.admin: AdminClient = clients.admin_client(pipeline)
        self._lock = threading.Lock()
        self._metadata = None
        self._failure: tuple[str, KafkaSourceError] | None = None  # (the pipeline that asked, its error)
        self._bounds: dict[KafkaPartition, PartitionBounds] = {}

    def metadata(self, pipeline: Pipeline):
        with self._lock:  # the others wait for the first request's answer, or its failure
            if self._metadata is None and self._failure is None:
                try:
                    self._metadata = clients.cluster_metadata(self.admin, pipeline)
                except KafkaSourceError as exc:
                    self._failure = (pipeline.name, exc)
            if self._failure is not None:
                asked, exc = self._failure
                raise KafkaSourceError(str(exc).replace(f"pipeline {asked}: ", f"pipeline {pipeline.name}: ", 1)) from exc
            return self._metadata

    def log_bounds(self, pipeline: Pipeline, partitions: Sequence[KafkaPartition]) -> dict[KafkaPartition, PartitionBounds]:
        with self._lock:
            missing = [p for p in partitions if p not in self._bounds]
        if missing:
            found = clients.log_bounds(self.admin, pipeline, missing)
            with self._lock:
                self._bounds.update(found)
        with self._lock:
            return {p: self._bounds[p] for p in partitions}


class ClusterLookups:
    """The Kafka lookups of ``report.status``, shared by every pipeline on the same cluster."""

    def __init__(self) -> None:
        self._clusters: dict[str, _Cluster] = {}
        self._lock = threading.Lock()

    def _cluster(self, pipeline: Pipeline) -> _Cluster:
        key = cluster_identity(pipeline)
        with self._lock:
            if key not in self._clusters:
                self._clusters[key] = _Cluster(pipeline)  # a client that cannot be made fails its asker, kept for none
            return self._clusters[key]

    def metadata(self, pipeline: Pipeline):
        """The cluster's metadata (``clients.cluster_metadata``), asked once."""
        return self._cluster(pipeline).metadata(pipeline)

    def describe_source(self, pipeline: Pipeline) -> SourceState:
        cluster = self._cluster(pipeline)
        return clients.describe_source(cluster.admin, pipeline, cluster.metadata(pipeline))

    def log_bounds(self, pipeline: Pipeline, partitions: Iterable[KafkaPartition]) -> dict[KafkaPartition, PartitionBounds]:
        return self._cluster(pipeline).log_bounds(pipeline, list(partitions))

    def prefetch(self, pipelines: Sequence[Pipeline]) -> None:
        """Per cluster: its metadata, then the log bounds of every partition of the topics its
        pipelines read, in one ListOffsets pair. What fails here is asked again by each pipeline,
        whose error then names it; nothing is hidden."""
        by_cluster: dict[str, list[Pipeline]] = defaultdict(list)
        for pipeline in pipelines:
            by_cluster[cluster_identity(pipeline)].append(pipeline)
        for members in by_cluster.values():
            try:
                cluster = self._cluster(members[0])
                metadata = cluster.metadata(members[0])
            except (KafkaSourceError, KafkaException, OncemoreError):  # each pipeline asks again, naming itself
                continue
            read = {t for p in members for t in metadata.topics if p.source.subscribes(t)}
            partitions = sorted(KafkaPartition(t, n) for t in read if metadata.topics[t].error is None
                                for n in metadata.topics[t].partitions)
            try:
                cluster.log_bounds(members[0], partitions)
            except KafkaSourceError:  # asked again per pipeline, as above
                continue
