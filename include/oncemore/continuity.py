"""Whether a table's positions may be continued: checked before a run plans or a reset commits,
so nothing is read on positions that no longer mean what they meant.

Refused, each naming pipeline, topic and what was found: a topic another pipeline ingests into
the same table (both would plan the same ranges, every record twice); positions missing from a
table that holds data or commits (they expired, the pipeline was renamed, another tool wrote
it); another cluster; a recreated topic (new topic ID); a position beyond the log end.
"""

from __future__ import annotations

import json
from typing import Mapping

from .commitrecord import CommitEntry
from .config import Pipeline, known_pipeline_names
from .coordinates import KafkaPartition, nested
from .errors import PositionsMissing, TableOwned, TopicChanged
from .kafka import PartitionBounds, TopicIdentity
from .ledger import NO_ID, RECENT_HISTORY, Ledger, fingerprint


def check_continuity(
    pipeline: Pipeline,
    ledger: Ledger,
    table,
    positions: Mapping[KafkaPartition, int | None],
    identities: Mapping[str, TopicIdentity],
    log: Mapping[KafkaPartition, PartitionBounds],
) -> None:
    """Refuses to plan when the table's positions cannot be trusted to continue (module docstring).
    A topic with no position at all while others have some is new to the pipeline (a pattern
    matched it): it starts at ``starting_offsets``."""
    if table is None:
        return
    for topic in sorted(identities):
        check_owner(pipeline, ledger, table, topic)
    if all(v is None for v in positions.values()):
        version = table.version()
        # Data, or an oncemore commit: a table only created or altered (constraints, properties) is new.
        if table.get_add_actions(flatten=False).num_rows or ledger.recent_commits(RECENT_HISTORY, table):
            raise PositionsMissing(
                f"pipeline {pipeline.name}: table {pipeline.sink.table_uri} (version {version}) holds commits or "
                f"data but no positions for this pipeline's {pipeline.source.describe_subscription()}"
                f"{_missing_hint(ledger, table)}. They expired (delta.setTransactionRetentionDuration), the pipeline "
                "was renamed, or another tool wrote the table; oncemore does not ingest from starting_offsets over "
                f"them. Set positions deliberately: `oncemore reset {pipeline.name} --to earliest|latest|TIMESTAMP|"
                f"'{{\"TOPIC\": {{\"0\": OFFSET}}}}'`.",
                pipeline=pipeline.name, table_uri=pipeline.sink.table_uri, version=version,
            )
        return
    for topic, identity in sorted(identities.items()):
        held = {p: v for p, v in positions.items() if p.topic == topic and v is not None}
        if held:
            check_identity(pipeline, ledger, table, topic, identity, held)
    for partition, position in sorted(positions.items()):
        if position is not None and position > log[partition].latest:
            raise TopicChanged(
                f"pipeline {pipeline.name}: {partition}: committed position {position} is beyond the log end "
                f"{log[partition].latest} (log start {log[partition].earliest}): the topic was recreated or "
                f"truncated. oncemore never resets positions by itself: `oncemore reset {pipeline.name} --to ...`.",
                pipeline=pipeline.name, topic=partition.topic, partition=partition.partition, position=position,
                log_end=log[partition].latest,
            )


def check_identity(pipeline: Pipeline, ledger: Ledger, table, topic: str, identity: TopicIdentity,
                   positions: Mapping[KafkaPartition, int]) -> None:
    """The positions of ``topic`` refer to the topic and cluster the broker reports now. The
    snapshot holds their fingerprints beside the positions; a table whose commits predate them
    (format < 4) is checked against its newest commit record, searched through the whole log once
    (the next commit records the fingerprints)."""
    claims = ledger.claims(topic, table)
    if claims.topic_id is not None or claims.cluster_id is not None:
        cluster_changed = bool(identity.cluster_id) and claims.cluster_id not in (None, NO_ID, fingerprint(identity.cluster_id))
        topic_changed = bool(identity.topic_id) and claims.topic_id not in (None, NO_ID, fingerprint(identity.topic_id))
        if not (cluster_changed or topic_changed):
            return
        last = ledger.last_commit(topic, table)  # only to name the IDs in the error, when still in recent history
    else:
        last = ledger.last_commit(topic, table, limit=None)
        committed = last.record if last is not None else None
        before_topic_id = committed.topic_ids.get(topic) if committed else None
        cluster_changed = bool(committed and committed.cluster_id and identity.cluster_id
                               and committed.cluster_id != identity.cluster_id)
        topic_changed = bool(before_topic_id and identity.topic_id and before_topic_id != identity.topic_id)
    committed = last.record if last is not None else None
    version = f"version {last.version}" if last is not None else f"before version {table.version() + 1}"
    where = f"pipeline {pipeline.name}: topic {topic}"
    if cluster_changed:
        before = committed.cluster_id if committed and committed.cluster_id else "another cluster"
        raise TopicChanged(
            f"{where}: the positions were committed ({version}) reading cluster {before}, the broker at "
            f"{pipeline.source.bootstrap_servers} is cluster {identity.cluster_id}: offsets of another cluster mean "
            f"nothing here. Point the pipeline back, or start over deliberately with `oncemore reset {pipeline.name} --to ...`.",
            pipeline=pipeline.name, topic=topic, committed_cluster_id=committed.cluster_id if committed else None,
            cluster_id=identity.cluster_id,
        )
    if topic_changed:
        before = committed.topic_ids.get(topic) if committed and committed.topic_ids.get(topic) else "another topic ID"
        raise TopicChanged(
            f"{where}: the topic was deleted and recreated: positions {json.dumps(nested(positions)[topic])} were "
            f"committed ({version}) for topic ID {before}, the topic now has ID {identity.topic_id}. Its offsets start "
            f"over, so nothing is read; to ingest the new topic, `oncemore reset {pipeline.name} --topic {topic} --to "
            "earliest` (or latest, a timestamp, offsets).",
            pipeline=pipeline.name, topic=topic, committed_topic_id=committed.topic_ids.get(topic) if committed else None,
            topic_id=identity.topic_id, positions={str(p): v for p, v in positions.items()},
        )


def check_owner(pipeline: Pipeline, ledger: Ledger, table, topic: str, take_over: bool = False) -> None:
    """Refuses a pipeline's commits for a topic that another pipeline ingests into the same table:
    both would plan the same ranges, duplicating every record. A deliberate hand-over (``oncemore
    reset --take-over``) passes; its commit makes this pipeline the owner, and the other one's
    runs are refused from then on."""
    if take_over or table is None:
        return
    owner = ledger.claims(topic, table).owner
    if owner == fingerprint(pipeline.name):
        return
    recent = ledger.recent_commits(RECENT_HISTORY, table)
    if owner is None:  # commits before format 4 name no owner: their records still tell
        others = [e for e in recent if topic in e.record.topics and e.record.pipeline != pipeline.name]
        if not others:
            return
        other = others[0].record.pipeline
    else:
        known = {fingerprint(name): name for name in [e.record.pipeline for e in recent] + known_pipeline_names()}
        other = known.get(owner, "another pipeline (not among this table's recent commits or the configured pipelines)")
    raise TableOwned(
        f"pipeline {pipeline.name}: topic {topic} is ingested into {pipeline.sink.table_uri} by pipeline {other}; a "
        f"table belongs to one pipeline, and a second one would ingest every record again. Point {pipeline.name} at "
        f"another table, or hand the topic over deliberately: `oncemore reset {pipeline.name} --to ... --take-over` "
        f"({other}'s runs are refused from then on).",
        pipeline=pipeline.name, topic=topic, table_uri=pipeline.sink.table_uri, owner=other,
    )


def _missing_hint(ledger: Ledger, table) -> str:
    """What recent history says about the missing positions: this pipeline's last ranges, or
    which pipelines did commit here (a rename)."""
    commits = ledger.recent_commits(50, table)
    own = [c for c in commits if c.record.pipeline == ledger.pipeline]
    if own:
        return f" (its newest commit, version {own[0].version}, left positions at {json.dumps(_left_at(own[0]), sort_keys=True)})"
    others = sorted({c.record.pipeline for c in commits})
    return f" (recent oncemore commits here are by {', '.join(others)})" if others else ""


def _left_at(entry: CommitEntry) -> dict:
    record = entry.record
    if record.reset is not None:
        return dict(record.reset.to_positions)
    return {topic: {p: end for p, (_, end) in partitions.items()} for topic, partitions in record.ranges.items()}
