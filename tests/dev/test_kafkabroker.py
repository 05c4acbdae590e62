"""The local broker's start (devtools.kafkabroker.start_kafka): what a broker it returns already serves."""

from __future__ import annotations

import logging


def test_a_started_broker_hands_out_producer_ids_so_the_first_producer_warns_of_nothing(own_broker, caplog):
    local = own_broker()
    local.create_topic("first", 1)

    with caplog.at_level(logging.INFO, logger="devtools.kafkabroker"):
        local.produce("first", [(0, None, b"v", None)])
        local.restart()  # a restarted broker asks its controller for producer IDs anew
        local.produce("first", [(0, None, b"w", None)])

    # librdkafka's "GETPID ... Failed to acquire idempotence PID ...: Coordinator load in progress: retrying".
    said = [r.getMessage() for r in caplog.records if r.name == "devtools.kafkabroker" and r.levelno >= logging.WARNING]
    assert not said, said
