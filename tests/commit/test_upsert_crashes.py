"""An upsert run SIGKILLed at each step core/crashpoints.py names on its path: two racing reruns
from there end with the table equal to the fold of the events, key by key, every record of the
committed ranges accounted for, and each table's part committed once."""

from __future__ import annotations

import pytest
from deltalake import DeltaTable

from conftest import oncemore_command, oncemore_commits
from devtools.changefeed import debezium_events, produce
from test_upsert import accounted, assert_folded, debezium

pytestmark = pytest.mark.spark

BROKEN = b"{broken"


def commits(pipeline) -> tuple[int, int, int]:
    return tuple(len(oncemore_commits(uri)) if DeltaTable.is_deltatable(uri) else 0
                 for uri in (pipeline.sink.table_uri, pipeline.sink.quarantine_uri, pipeline.sink.tombstones_uri))


# (merge, step, oncemore commits in (main, quarantine, tombstones) right after the crash)
# planned and written are as on the append path (tests/run/test_crashes.py): nothing of the part is there yet.
# upsert.merge cluster (test_upsert.py's MERGES) adds a step: the touched files rewritten (and checked), before
# the part's tombstones and main commits. A cluster case costs about a minute on 2 cores, so cluster runs only
# the steps its own code reaches: validated and quarantine_committed come before the MERGE (commit/part.py, shared
# code: the local cases cover them).
STEPS = [("local", "validated", (0, 0, 0)), ("local", "quarantine_committed", (0, 1, 0)),
         ("local", "tombstones_committed", (0, 1, 1)), ("local", "main_committed", (1, 1, 1)),
         ("cluster", "rewritten", (0, 1, 0)), ("cluster", "tombstones_committed", (0, 1, 1)),
         ("cluster", "main_committed", (1, 1, 1))]


@pytest.mark.parametrize("merge,step,expected", STEPS, ids=[f"{m}-{s}" for m, s, _ in STEPS])
def test_an_upsert_run_killed_at_each_step_ends_folded_after_two_racing_reruns(merge, step, expected, broker, topic,
                                                                                 make_pipeline, spark):
    events = debezium_events(keys=25, changes=250, seed=11)
    broker.produce(topic, [(p, b'{"id": 1}', BROKEN, None) for p in (0, 1, 2)])  # quarantined, in the first part
    produce(broker.bootstrap_servers, topic, events, "shuffled", seed=5)
    pipeline = debezium(make_pipeline, topic, sequence_by="source.lsn", merge=merge,
                        limits={"max_records_per_commit": 240})
    process = oncemore_command(pipeline, "run", step)
    _, err = process.communicate(timeout=600)
    assert process.returncode < 0, err[-2000:]
    assert commits(pipeline) == expected
    racers = [oncemore_command(pipeline, "run") for _ in range(2)]
    results = [(r.wait(timeout=600), r.communicate()[1]) for r in racers]
    assert [code for code, _ in results] == [0, 0], [e[-2000:] for _, e in results]
    assert_folded(pipeline, broker, topic, sequence=lambda value: value["source"]["lsn"], skip=BROKEN)
    accounted(pipeline)
    main, quarantine, _ = commits(pipeline)
    # Each batch's main commit once, the first batch's quarantine commit once, whichever racer made them.
    assert (main, quarantine) == (2, 1)
