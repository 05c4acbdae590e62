"""A pipeline file, loaded and checked before anything runs: the values it states (values.py),
the pipeline model (model.py), and the files read into it (loading.py).
"""
