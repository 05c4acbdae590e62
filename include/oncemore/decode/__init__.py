"""Kafka records to rows of the table: a pipeline's formats resolved once on the driver
(resolve.py) into the RecordSpec executors rebuild their decoders from (recordspec.py), each
format's decoder behind one interface (decoder.py; json/, avro/, protobuf/, with the registry
client and Confluent's framing), and a batch's rows and quarantine rows (rows.py).
"""
