"""The avro format in Confluent's wire format: schemas as tables see them (schemas.py),
how a writer stands to the reader (compare.py), a reader that covers a writer ahead of it
(merge.py), and the decoder (decoder.py).
"""
