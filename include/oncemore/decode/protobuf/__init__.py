"""The protobuf format in Confluent's wire format: registered schemas as tables see
them (schemas.py), and the decoder (decoder.py).
"""
