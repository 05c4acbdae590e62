"""Whether a table's positions may be continued: checked before a run plans or a reset commits,
so nothing is read on positions that no longer mean what they meant.

Refused, each naming pipeline, topic and what was found: a topic another pipeline ingests into
the same table (both would plan the same ranges, every record twice); positions missing from a
table that holds data or commits (they expired, the table is another pipeline's, another tool
wrote it, or the log no longer keeps the commits that would tell: then where its rows reach is
named), and a handed plan's whose positions went missing since it was made; another cluster; a
recreated topic (new topic ID); a position beyond the log end. A pipeline whose topics were all
replaced (dated or rotated topics of a pattern) is not refused: the topics it reads now are new to
it.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping

import pyarrow as pa
from deltalake import QueryBuilder

from oncemore.config.loading import known_pipeline_names
from oncemore.config.model import Pipeline
from oncemore.core.columns import OFFSET_COLUMN, PARTITION_COLUMN, TOPIC_COLUMN
from oncemore.core.coordinates import KafkaPartition, nested
from oncemore.core.errors import PositionsMissing, TableOwned, TopicChanged
from oncemore.kafka.clients import PartitionBounds, TopicIdentity
from oncemore.plan.commitinfo import CommitEntry
from oncemore.plan.ledger import NO_ID, RECENT_HISTORY, Ledger, fingerprint, open_table


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
    matched it): it starts at ``starting_offsets``; so does every topic when the pipeline's newest
    commit was on topics it no longer reads."""
    if table is None:
        return
    for topic in sorted(identities):
        check_owner(pipeline, ledger, table, topic)
    if all(v is None for v in positions.values()):
        check_positions_held(pipeline, ledger, table, positions)
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
    (format < 4) is checked against its newest commit record on the topic: in recent history, else
    searched through the whole log (each plan until the next commit records the fingerprints)."""
    claims = ledger.claims(topic, table)
    if claims.topic_id is not None or claims.cluster_id is not None:
        cluster_changed = bool(identity.cluster_id) and claims.cluster_id not in (None, NO_ID, fingerprint(identity.cluster_id))
        topic_changed = bool(identity.topic_id) and claims.topic_id not in (None, NO_ID, fingerprint(identity.topic_id))
        if not (cluster_changed or topic_changed):
            return
        last = ledger.last_commit(topic, table)  # only to name the IDs in the error, when still in recent history
    else:
        last = ledger.last_commit(topic, table) or ledger.last_commit(topic, table, limit=None)
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
        f"pipeline {pipeline.name}: topic {topic} is ingested into {ledger.table_uri} by pipeline {other}; a "
        f"table belongs to one pipeline, and a second one would ingest every record again. Point {pipeline.name} at "
        f"another table, or hand the topic over deliberately: `oncemore reset {pipeline.name} --to ... --take-over` "
        f"({other}'s runs are refused from then on).",
        pipeline=pipeline.name, topic=topic, table_uri=ledger.table_uri, owner=other,
    )


def check_positions_held(pipeline: Pipeline, ledger: Ledger, table, positions: Mapping[KafkaPartition, int | None]) -> None:
    """Where ``table`` holds none of ``positions`` (the snapshot's, of a plan's partitions) but
    holds data or an oncemore commit, check_positions_kept; a table only created or altered
    (constraints, properties) is new. A plan handed to a run is checked here too: a plan made
    before its positions expired would otherwise read its ranges again from no position."""
    if table is None or any(v is not None for v in positions.values()):
        return
    if table.get_add_actions(flatten=False).num_rows or ledger.recent_commits(RECENT_HISTORY, table):
        check_positions_kept(pipeline, ledger, table, {p.topic for p in positions})


def check_positions_kept(pipeline: Pipeline, ledger: Ledger, table, topics: Iterable[str]) -> None:
    """For a table that holds data or commits but no position of the pipeline's ``topics``: passes
    when the pipeline's newest commit was on other topics only (deleted since, or no longer matching
    its pattern: the topics it reads now are new to it, and start at ``starting_offsets``); else
    PositionsMissing, naming why: the table is another pipeline's, another tool's, or the positions
    of a topic it still reads expired."""
    where = f"pipeline {pipeline.name}: table {ledger.table_uri} (version {table.version()})"
    own = ledger.newest_batch(table)
    if own is None:
        others = sorted({e.record.pipeline for e in ledger.recent_commits(RECENT_HISTORY, table)})
        if others:
            raise PositionsMissing(
                f"{where} belongs to pipeline {', '.join(others)}: its oncemore commits are by {', '.join(others)}, "
                f"none by {pipeline.name}. A table belongs to one pipeline: point {pipeline.name}'s sink.table_uri at "
                "a table of its own.",
                pipeline=pipeline.name, table_uri=ledger.table_uri, owners=others, version=table.version())
        kept = ledger.kept_versions(table)
        if kept and kept[0] > 0:
            raise PositionsMissing(
                f"{where} holds data but no position of pipeline {pipeline.name}, and its log no longer keeps the "
                f"commits before version {kept[0]} (delta.logRetentionDuration): positions that expired "
                "(delta.setTransactionRetentionDuration) cannot be told from another tool's data any more, and "
                f"oncemore does not ingest from starting_offsets over them. {_reach_hint(pipeline, table, topics)}",
                pipeline=pipeline.name, table_uri=ledger.table_uri, version=table.version(),
                first_kept_version=kept[0])
        raise PositionsMissing(
            f"{where} holds data that no oncemore pipeline committed (another tool wrote it): point "
            f"{pipeline.name}'s sink.table_uri at a table of its own, or start on this one deliberately with "
            f"`oncemore reset {pipeline.name} --to earliest|latest|TIMESTAMP|'{{\"TOPIC\": {{\"0\": OFFSET}}}}'`.",
            pipeline=pipeline.name, table_uri=ledger.table_uri, version=table.version())
    stated = ledger.stated_positions(own.version)
    if not ({p.topic for p in stated} | set(own.record.topics)) & set(topics):
        return  # its newest commit was on topics it no longer reads: the ones it reads now are new to it
    left = json.dumps(_left_at(own, stated), sort_keys=True)
    raise PositionsMissing(
        f"{where} holds no position of pipeline {pipeline.name} for its {pipeline.source.describe_subscription()}: "
        f"its newest commit, version {own.version}, left positions at {left}, and the table's snapshot no longer "
        "holds them: they expired (delta.setTransactionRetentionDuration). oncemore does not ingest from "
        f"starting_offsets over them. Continue from them deliberately: `oncemore reset {pipeline.name} --to "
        f"'{left}'` (or earliest, latest, a timestamp).",
        pipeline=pipeline.name, table_uri=ledger.table_uri, version=table.version(),
        newest_commit=own.version)


def _reach_hint(pipeline: Pipeline, table, topics: Iterable[str]) -> str:
    """Where the rows of the pipeline's tables (main and quarantine) reach in ``topics``, as the reset
    that continues after them: every offset a committed range turned into a row lies below, and one
    that made none (filtered, a transaction marker) makes none when read again."""
    wanted, reach = set(topics), {}
    quarantine = open_table(pipeline.sink.quarantine_uri, pipeline.sink.storage_options)
    for held in (table, quarantine):
        if held is None or not {TOPIC_COLUMN, PARTITION_COLUMN, OFFSET_COLUMN} <= {f.name for f in held.schema().fields}:
            continue
        rows = pa.table(QueryBuilder().register("t", held).execute(
            f"SELECT {TOPIC_COLUMN} AS t, {PARTITION_COLUMN} AS p, max({OFFSET_COLUMN}) + 1 AS reach FROM t GROUP BY 1, 2"
        ).read_all()).to_pylist()
        for row in rows:
            if row["t"] in wanted:
                key = KafkaPartition(row["t"], row["p"])
                reach[key] = max(reach.get(key, 0), row["reach"])
    if not reach:
        return (f"Start on it deliberately: `oncemore reset {pipeline.name} --to earliest|latest|TIMESTAMP|"
                "'{\"TOPIC\": {\"0\": OFFSET}}'`.")
    after = json.dumps(nested(reach), sort_keys=True)
    return (f"Its rows reach offsets {after}: continue after them deliberately with `oncemore reset {pipeline.name} "
            f"--to '{after}'` (or earliest, latest, a timestamp).")


def _left_at(entry: CommitEntry, stated: Mapping[KafkaPartition, int]) -> dict:
    """Where a commit left the pipeline's partitions: the positions it stated, else (formats before
    every commit stated them all) its reset's or its ranges' ends."""
    if stated:
        return nested(stated)
    record = entry.record
    if record.reset is not None:
        return dict(record.reset.to_positions)
    return {topic: {p: end for p, (_, end) in partitions.items()} for topic, partitions in record.ranges.items()}
