"""The planner is a pure function of ledger positions and log bounds: tested without a broker."""

from __future__ import annotations

import pytest

from oncemore.config import OffsetBound, parse_pipeline
from oncemore.kafka import PartitionBounds
from oncemore.ledger import Gap
from oncemore.planner import Plan, PlanError, plan


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
    result = plan(pipeline(), {0: 40, 1: 50, 2: None}, log, starts={0: 0, 1: 0, 2: 10}, ends={0: 100, 1: 50, 2: 30})
    assert ranges(result) == [[(0, 40, 100), (2, 10, 30)]]
    assert result.batches[0].expected_positions == {0: 40, 2: None}


def test_nothing_new_is_an_empty_plan():
    log = bounds((0, 100), (0, 50))
    assert plan(pipeline(), {0: 100, 1: 50}, log, {0: 0, 1: 0}, {0: 100, 1: 50}).is_empty


def test_same_inputs_same_plan():
    args = (pipeline(max_records=33), {0: 5, 1: None}, bounds((0, 100), (0, 80)), {0: 0, 1: 0}, {0: 100, 1: 80})
    assert plan(*args) == plan(*args)
    assert Plan.from_json(plan(*args).to_json()) == plan(*args)


def test_chunks_by_max_records_per_commit_fairly_and_contiguously():
    result = plan(pipeline(max_records=100), {0: 0, 1: 0, 2: 0}, bounds((0, 250), (0, 10), (0, 90)),
                  {0: 0, 1: 0, 2: 0}, {0: 250, 1: 10, 2: 90})
    batches = ranges(result)
    assert all(sum(e - s for _, s, e in b) <= 100 for b in batches)
    assert sum(b.offset_count for b in result.batches) == 350
    assert batches[0] == [(0, 0, 45), (1, 0, 10), (2, 0, 45)]
    cursor = {0: 0, 1: 0, 2: 0}
    for batch in result.batches:
        for r in batch.ranges:
            assert batch.expected_positions[r.partition] == cursor[r.partition] == r.start
            cursor[r.partition] = r.end
    assert cursor == {0: 250, 1: 10, 2: 90}


def test_until_offsets_leave_unnamed_partitions_alone_and_never_go_backwards():
    log = bounds((0, 100), (0, 100))
    result = plan(pipeline(), {0: 50, 1: 20}, log, {0: 0, 1: 0}, ends={0: 30, 1: None})
    assert result.is_empty
    result = plan(pipeline(), {0: 50, 1: 20}, log, {0: 0, 1: 0}, ends={0: 70, 1: None})
    assert ranges(result) == [[(0, 50, 70)]]


def test_until_beyond_log_end_is_clamped_to_it():
    result = plan(pipeline(), {0: 0}, bounds((0, 10)), {0: 0}, ends={0: 1_000})
    assert ranges(result) == [[(0, 0, 10)]]


def test_data_loss_fails_naming_topic_partition_and_offsets():
    with pytest.raises(PlanError, match=r"orders/1: offsets \[20, 60\) are no longer in the log"):
        plan(pipeline(), {0: 0, 1: 20}, bounds((0, 10), (60, 100)), {0: 0, 1: 0}, {0: 10, 1: 100})


def test_data_loss_allowed_skips_ahead_and_records_the_gap():
    result = plan(pipeline(fail_on_data_loss=False), {0: 20}, bounds((60, 100)), {0: 0}, {0: 100})
    assert ranges(result) == [[(0, 60, 100)]]
    assert result.batches[0].gaps == (Gap("orders", 0, 20, 60),)
    assert result.batches[0].expected_positions == {0: 20}


def test_position_beyond_log_end_is_an_error_not_a_reset():
    with pytest.raises(PlanError, match="orders/0: committed position 500 is beyond the log end 20.*recreated"):
        plan(pipeline(), {0: 500}, bounds((0, 20)), {0: 0}, {0: 20})


def test_latest_start_is_recorded_in_the_ledger_even_with_nothing_to_read():
    result = plan(pipeline(starting="latest"), {0: None, 1: None}, bounds((0, 40), (0, 7)), {0: 40, 1: 7}, {0: 40, 1: 7})
    assert ranges(result) == [[(0, 40, 40), (1, 7, 7)]]
    assert result.batches[0].expected_positions == {0: None, 1: None}


def test_first_commit_records_every_partition_even_empty_or_unnamed_ones():
    result = plan(pipeline(), {0: None, 1: None, 2: None}, bounds((0, 10), (0, 0), (0, 5)), {0: 0, 1: 0, 2: 0},
                  ends={0: 10, 1: 0, 2: None})
    assert ranges(result) == [[(0, 0, 10), (1, 0, 0), (2, 0, 0)]]


def test_after_the_first_commit_only_partitions_with_records_are_touched():
    result = plan(pipeline(), {0: 10, 1: 0, 2: None}, bounds((0, 12), (0, 0), (0, 0)), {0: 0, 1: 0, 2: 0},
                  ends={0: 12, 1: 0, 2: 0})
    assert ranges(result) == [[(0, 10, 12)]]


def test_earliest_start_with_empty_partitions_is_a_noop():
    assert plan(pipeline(), {0: None}, bounds((0, 0)), {0: 0}, {0: 0}).is_empty


def test_offset_bound_until_keywords():
    assert OffsetBound.parse("latest", allowed=("latest",)).kind == "latest"
    with pytest.raises(ValueError):
        OffsetBound.parse("earliest", allowed=("latest",))
