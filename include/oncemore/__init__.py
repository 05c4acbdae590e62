"""oncemore: exactly-once batch ingestion from Kafka into Delta Lake."""

__version__ = "0.1.0"
