import pyarrow as pa

from oncemore.core import hours


def test_rows_are_counted_by_the_hour_of_their_kafka_timestamp_and_those_iso_text_cannot_name_are_left_out():
    now_ms = 1_767_610_800_000  # 2026-01-05T11:00:00Z
    stamps = pa.array([now_ms, now_ms + 1, now_ms + 3_600_000, now_ms * 1000, -1, None], pa.timestamp("ms", tz="UTC"))
    counted: hours.Hours = {}

    hours.count(counted, stamps, hours.QUARANTINED)

    assert counted == {"1969-12-31T23:00:00Z": [0, 1], "2026-01-05T11:00:00Z": [0, 2], "2026-01-05T12:00:00Z": [0, 1]}


def test_a_batch_within_one_hour_beyond_year_9999_counts_nothing():
    counted: hours.Hours = {}

    hours.count(counted, pa.array([1_767_610_800_000_000] * 2, pa.timestamp("ms", tz="UTC")), hours.WRITTEN)

    assert counted == {}
