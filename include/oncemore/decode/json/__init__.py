"""The json format: values parsed against a declared schema (decoder.py), by Arrow's
reader in the types it can read (types.py), after each value is checked to be exactly one JSON
object (objects.py).
"""
