"""The planner is a pure function of ledger positions and log bounds: tested without a broker."""

from __future__ import annotations

import pytest

from oncemore.config.loading import parse_pipeline
from oncemore.config.model import Limits
from oncemore.config.values import OffsetBound
from oncemore.core.coordinates import KafkaPartition
from oncemore.core.coordinates import OffsetRange as Range
from oncemore.core.errors import DataLoss, PlanError, StalePlan
from oncemore.kafka.clients import PartitionBounds, TopicIdentity
from oncemore.plan.commitinfo import Gap
from oncemore.plan.planner import Batch, Plan, group_tasks, plan, split_tasks

TOPIC = "orders"


def K(values):
    """Values by partition number (of the one topic these tests plan) keyed as the planner keys them."""
    return {KafkaPartition(TOPIC, p): v for p, v in values.items()}


def OffsetRange(partition, start, end):
    return Range(TOPIC, partition, start, end)


def planned(pipeline_, positions, log, starts, ends, **kwargs):
    return plan(pipeline_, K(positions), K(log), K(starts), K(ends), **kwargs)


def pipeline(max_records=1_000_000, fail_on_data_loss=True, starting="earliest"):
    return parse_pipeline({
        "name": "orders",
        "source": {"bootstrap_servers": "k:9092", "topic": "orders", "starting_offsets": starting},
        "sink": {"table_uri": "/tmp/t"},
        "format": {"type": "raw"},
        "limits": {"max_records_per_commit": max_records},
        "fail_on_data_loss": fail_on_data_loss,
    }, "test.yaml", {})


def bounds(*pairs):
    return {p: PartitionBounds(e, l) for p, (e, l) in enumerate(pairs)}


def ranges(result: Plan):
    return [[(r.partition, r.start, r.end) for r in b.ranges] for b in result.batches]


def test_plans_from_positions_to_log_end_and_new_partitions_from_starting_offsets():
    log = bounds((0, 100), (0, 50), (10, 30))
    result = planned(pipeline(), {0: 40, 1: 50, 2: None}, log, starts={0: 0, 1: 0, 2: 10}, ends={0: 100, 1: 50, 2: 30})
    assert ranges(result) == [[(0, 40, 100), (2, 10, 30)]]
    assert result.batches[0].expected_positions == K({0: 40, 2: None})


def test_nothing_new_is_an_empty_plan():
    log = bounds((0, 100), (0, 50))
    assert planned(pipeline(), {0: 100, 1: 50}, log, {0: 0, 1: 0}, {0: 100, 1: 50}).is_empty


def test_same_inputs_same_plan():
    args = (pipeline(max_records=33), {0: 5, 1: None}, bounds((0, 100), (0, 80)), {0: 0, 1: 0}, {0: 100, 1: 80})
    assert planned(*args) == planned(*args)
    with_identity = planned(*args, identities={TOPIC: TopicIdentity("AbCd", "cluster-1")})
    assert Plan.from_json(with_identity.to_json()) == with_identity
    assert with_identity.table_uri == "/tmp/t"


def test_chunks_by_max_records_per_commit_fairly_and_contiguously():
    result = planned(pipeline(max_records=100), {0: 0, 1: 0, 2: 0}, bounds((0, 250), (0, 10), (0, 90)),
                  {0: 0, 1: 0, 2: 0}, {0: 250, 1: 10, 2: 90})
    batches = ranges(result)
    assert all(sum(e - s for _, s, e in b) <= 100 for b in batches)
    assert sum(b.offset_count for b in result.batches) == 350
    assert batches[0] == [(0, 0, 45), (1, 0, 10), (2, 0, 45)]
    cursor = {0: 0, 1: 0, 2: 0}
    for batch in result.batches:
        for r in batch.ranges:
            assert batch.expected_positions[r.key] == cursor[r.partition] == r.start
            cursor[r.partition] = r.end
    assert cursor == {0: 250, 1: 10, 2: 90}


def test_until_offsets_leave_unnamed_partitions_alone_and_never_go_backwards():
    log = bounds((0, 100), (0, 100))
    result = planned(pipeline(), {0: 50, 1: 20}, log, {0: 0, 1: 0}, ends={0: 30, 1: None})
    assert result.is_empty
    result = planned(pipeline(), {0: 50, 1: 20}, log, {0: 0, 1: 0}, ends={0: 70, 1: None})
    assert ranges(result) == [[(0, 50, 70)]]


def test_until_beyond_log_end_is_clamped_to_it():
    result = planned(pipeline(), {0: 0}, bounds((0, 10)), {0: 0}, ends={0: 1_000})
    assert ranges(result) == [[(0, 0, 10)]]


def test_data_loss_fails_naming_topic_partition_and_offsets():
    with pytest.raises(DataLoss, match=r"pipeline orders: orders/1: offsets \[20, 60\) are no longer in the log"):
        planned(pipeline(), {0: 0, 1: 20}, bounds((0, 10), (60, 100)), {0: 0, 1: 0}, {0: 10, 1: 100})


def test_data_loss_allowed_skips_ahead_and_records_the_gap():
    result = planned(pipeline(fail_on_data_loss=False), {0: 20}, bounds((60, 100)), {0: 0}, {0: 100})
    assert ranges(result) == [[(0, 60, 100)]]
    assert result.batches[0].gaps == (Gap("orders", 0, 20, 60),)
    assert result.batches[0].expected_positions == K({0: 20})


def test_gaps_are_recorded_by_the_batch_that_crosses_them_even_past_the_first():
    # Five partitions, two records per commit: partitions 3 and 4 are first touched in later batches.
    log = bounds(*[(0, 4)] * 3, (50, 54), (70, 74))
    result = planned(pipeline(max_records=2, fail_on_data_loss=False), {p: 0 for p in range(5)}, log,
                  {p: 0 for p in range(5)}, {p: 74 for p in range(5)})
    crossing = {g.partition: b.seq for b in result.batches for g in b.gaps}
    assert sorted(crossing) == [3, 4]
    for partition, seq in crossing.items():
        batch = result.batches[seq]
        assert batch.expected_positions[KafkaPartition(TOPIC, partition)] == 0
        assert {r.partition: r.start for r in batch.ranges}[partition] == log[partition].earliest
    # Every batch records each partition it covers, and together they cover every range once.
    covered = {p: [] for p in range(5)}
    for batch in result.batches:
        assert set(batch.expected_positions) == {r.key for r in batch.ranges}
        for r in batch.ranges:
            covered[r.partition].append((r.start, r.end))
    for p, spans in covered.items():
        assert spans[0][0] == log[p].earliest and spans[-1][1] == 4 + (0 if p < 3 else log[p].earliest)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_starting_offset_beyond_log_end_is_an_error():
    with pytest.raises(PlanError, match="orders/0: starting offset 500 is beyond the log end 20"):
        planned(pipeline(), {0: None}, bounds((0, 20)), {0: 500}, {0: 20})


def batch():
    return Batch(seq=3, ranges=(OffsetRange(0, 10, 20), OffsetRange(1, 60, 70), OffsetRange(2, 5, 5)),
                 expected_positions=K({0: 10, 1: 40, 2: None}), gaps=(Gap("orders", 1, 40, 60),))


def test_a_batch_goes_on_from_the_current_positions_and_is_done_once_held():
    assert batch().remaining(K({0: 10, 1: 40, 2: None}), "w") == K({0: OffsetRange(0, 10, 20), 1: OffsetRange(1, 60, 70),
                                                                       2: OffsetRange(2, 5, 5)})
    # Partly committed (a retry after a crash, or byte budgets cut it): only the rest is left.
    assert batch().remaining(K({0: 15, 1: 65, 2: 5}), "w") == K({0: OffsetRange(0, 15, 20), 1: OffsetRange(1, 65, 70)})
    assert batch().remaining(K({0: 20, 1: 99, 2: 5}), "w") == {}


@pytest.mark.parametrize("positions, partition", [({0: 9, 1: 40, 2: None}, 0), ({0: 10, 1: 50, 2: None}, 1),
                                                   ({0: None, 1: 40, 2: None}, 0), ({0: 10, 1: 40, 2: 3}, 2)])
def test_positions_outside_a_batch_make_its_plan_stale(positions, partition):
    with pytest.raises(StalePlan, match=rf"w: orders/{partition}: the plan's batch 3 builds on position"):
        batch().remaining(K(positions), "w")


def test_tasks_are_cut_by_records_and_by_the_bytes_seen_and_share_the_commit_budget():
    limits = Limits(max_records_per_partition=100, max_bytes_per_task=1_000, max_bytes_per_commit=5_000)
    # Partition 0's sizes are unknown: records only. Partition 1's records are ~100 B: tasks of
    # ~800 B, and no more than 80% of its 2,500 B share of the commit.
    tasks, budget = split_tasks(K({0: OffsetRange(0, 0, 250), 1: OffsetRange(1, 10, 90)}), limits, K({1: 100.0}))
    assert tasks == [OffsetRange(0, 0, 100), OffsetRange(0, 100, 200), OffsetRange(0, 200, 250),
                     OffsetRange(1, 10, 18), OffsetRange(1, 18, 26), OffsetRange(1, 26, 30)]
    assert budget == 5_000 // 6
    assert split_tasks(K({0: OffsetRange(0, 0, 5)}), limits, {})[1] == 1_000
    # A record larger than every budget still makes a task of one record.
    assert split_tasks(K({0: OffsetRange(0, 0, 5)}), limits, K({0: 10_000_000.0}))[0] == [OffsetRange(0, 0, 1)]


def test_latest_start_is_recorded_in_the_ledger_even_with_nothing_to_read():
    result = planned(pipeline(starting="latest"), {0: None, 1: None}, bounds((0, 40), (0, 7)), {0: 40, 1: 7}, {0: 40, 1: 7})
    assert ranges(result) == [[(0, 40, 40), (1, 7, 7)]]
    assert result.batches[0].expected_positions == K({0: None, 1: None})


def test_first_commit_records_every_partition_even_empty_or_unnamed_ones():
    result = planned(pipeline(), {0: None, 1: None, 2: None}, bounds((0, 10), (0, 0), (0, 5)), {0: 0, 1: 0, 2: 0},
                  ends={0: 10, 1: 0, 2: None})
    assert ranges(result) == [[(0, 0, 10), (1, 0, 0), (2, 0, 0)]]


def test_after_the_first_commit_only_partitions_with_records_are_touched():
    result = planned(pipeline(), {0: 10, 1: 0, 2: None}, bounds((0, 12), (0, 0), (0, 0)), {0: 0, 1: 0, 2: 0},
                  ends={0: 12, 1: 0, 2: 0})
    assert ranges(result) == [[(0, 10, 12)]]


def test_earliest_start_with_empty_partitions_is_a_noop():
    assert planned(pipeline(), {0: None}, bounds((0, 0)), {0: 0}, {0: 0}).is_empty


def test_offset_bound_until_keywords():
    assert OffsetBound.parse("latest", allowed=("latest",)).kind == "latest"
    with pytest.raises(ValueError):
        OffsetBound.parse("earliest", allowed=("latest",))


def test_small_ranges_share_spark_tasks_balanced_by_offsets_and_large_ones_keep_their_own():
    tiny = [OffsetRange(p, 0, 1) for p in range(64)]
    groups = group_tasks(tiny, slots=2, max_records=1_000)
    assert len(groups) == 2 and sorted(t.partition for g in groups for t in g) == list(range(64))
    assert [len(g) for g in groups] == [32, 32]
    large = [OffsetRange(0, 0, 1_000), OffsetRange(0, 1_000, 2_000), OffsetRange(1, 0, 1_000)]
    groups = group_tasks(large + [OffsetRange(p, 0, 10) for p in range(2, 12)], slots=2, max_records=1_000)
    assert sorted(len(g) for g in groups) == [1, 1, 1, 10] and all(g[0] in large for g in groups if len(g) == 1)
    assert group_tasks([OffsetRange(0, 5, 6)], slots=8, max_records=1) == [[OffsetRange(0, 5, 6)]]
