"""A plan handed to a run (the Airflow plan task's, through XCom) checked before the run reads a
record: it must be this pipeline's, for its table and its topics, and each topic must still be the
one it was planned on.

Invariant: a handed plan whose topic was recreated meanwhile (its offsets restarted) is refused
with TopicChanged, and one whose table has lost its positions since (they expired) with
PositionsMissing (continuity.check_positions_held), and a routed pipeline's whose routes changed
while a table is behind with RoutesChanged (tables.Ledgers.check_routes), and one whose records a
crashed part judged under other settings with JudgingChanged (check_judging): nothing is read.
"""

from __future__ import annotations

from oncemore.config.model import Pipeline
from oncemore.core.errors import StalePlan, TopicChanged
from oncemore.core.storage import table_location
from oncemore.kafka import clients
from oncemore.plan.continuity import check_positions_held
from oncemore.plan.planner import Plan
from oncemore.plan.tables import Ledgers, plan_table_uri


def check_plan(pipeline: Pipeline, plan: Plan, ledgers: Ledgers) -> Plan:
    """``plan``, once checked (module docstring) against Kafka and the pipeline's tables (the
    ``ledgers`` it plans from: the main table's, or with routes every table's); StalePlan,
    TopicChanged or PositionsMissing otherwise."""
    where = f"pipeline {pipeline.name}"
    mismatches = [
        (what, planned, configured) for what, planned, configured in (
            ("pipeline", plan.pipeline, pipeline.name),
            ("table", table_location(plan.table_uri), table_location(plan_table_uri(pipeline))),
        ) if planned != configured
    ]
    foreign = [t for t in plan.topics if not pipeline.source.subscribes(t)]
    if foreign:
        mismatches.append(("topic", foreign[0], pipeline.source.describe_subscription()))
    if mismatches:
        what, planned, configured = mismatches[0]
        raise StalePlan(f"{where}: the plan is for {what} {planned}, the pipeline's is {configured}",
                        planned=planned, configured=configured)
    identities = clients.describe_source(clients.admin_client(pipeline), pipeline).identities
    for topic, planned in sorted(plan.identities.items()):
        now = identities.get(topic)
        if now is None or (planned.topic_id and now.topic_id and planned.topic_id != now.topic_id) or (
                planned.cluster_id and now.cluster_id and planned.cluster_id != now.cluster_id):
            raise TopicChanged(
                f"{where}: topic {topic}: the plan was made for topic ID {planned.topic_id} on cluster "
                f"{planned.cluster_id}, the broker now has "
                + (f"topic ID {now.topic_id} on cluster {now.cluster_id}" if now else "no such topic for the pipeline")
                + "; nothing was read",
                topic=topic, planned_topic_id=planned.topic_id, topic_id=now.topic_id if now else None,
            )
    for ledger in ledgers.planning().values():
        table = ledger.snapshot()
        check_positions_held(pipeline, ledger, table, ledger.positions(plan.positions, table))
    if ledgers.routed:
        ledgers.check_routes(plan.positions)
    else:
        ledgers.check_judging(plan.positions)
    return plan
