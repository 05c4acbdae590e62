"""Making a pipeline's Kafka clients, and saying what Kafka refuses them: a certificate, key or CA
file that cannot be opened or loaded (core/clientfiles.py), a right Kafka's authorizer denies.

The rights a run needs: DESCRIBE on each topic (Metadata, DescribeTopics, ListOffsets) and READ on
it (Fetch; READ includes DESCRIBE); with ``commit_consumer_group``, READ on the mirror's group
(commit/groupmirror.py). No right on any other group: confluent-kafka's consumer cannot be made
without a group id, which a reader never joins nor commits to; librdkafka asks for that group's
coordinator all the same, and the readers ignore its denial.

Invariant: an error names the pipeline, the option or the topic, and the right; never a value of
an option (a passphrase is named by its option alone).
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

from confluent_kafka import KafkaError, KafkaException

from oncemore.core.clientfiles import refused_file, unreadable
from oncemore.core.errors import KafkaAccessDenied, KafkaClientFileError

# The rights a pipeline's principal needs on its topics, said with every denial of one.
TOPIC_RIGHTS = "a pipeline needs READ on each of its topics (READ includes DESCRIBE)"
_Client = TypeVar("_Client")


def new_client(make: Callable[[dict], _Client], config: Mapping, pipeline: str) -> _Client:
    """``make(config)`` (an AdminClient, a Consumer), once the files its settings name were opened
    here (a Spark task opens them on its executor); KafkaClientFileError names the pipeline, the
    option and the file when one cannot be opened or librdkafka cannot load it (a wrong key
    passphrase, a file that is not PEM). librdkafka's own words name neither option nor file."""
    problem = unreadable(config)
    if problem is not None:
        option, path, why = problem
        raise KafkaClientFileError(f"pipeline {pipeline}: source.kafka_options.{option}: cannot read {path}: {why}",
                                   pipeline=pipeline, option=option, path=path)
    try:
        return make(dict(config))
    except KafkaException as exc:
        refused = refused_file(config, exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else "")
        if refused is None:
            raise
        option, path, why = refused
        named = f"{option}: cannot load {path}" if path else f"{option}: cannot load it"
        raise KafkaClientFileError(f"pipeline {pipeline}: source.kafka_options.{named}: {why}",
                                   pipeline=pipeline, option=option, path=path) from None


def topic_denied(where: str, topic: str, operation: str, note: str = "", after: str = "") -> KafkaAccessDenied:
    """Kafka's TOPIC_AUTHORIZATION_FAILED for ``operation`` (READ, DESCRIBE) on ``topic``, said
    (``note`` inside the parentheses, ``after`` at the end)."""
    return KafkaAccessDenied(f"{where}: Kafka denies {operation} on topic {topic!r} (TOPIC_AUTHORIZATION_FAILED{note}): "
                             f"{TOPIC_RIGHTS}{after}", resource="topic", name=topic, operation=operation)
