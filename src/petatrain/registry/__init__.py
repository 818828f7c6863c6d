"""The model registry of record (store.py: versions, aliases, the promotion lease) and the
evaluation gate a promotion passes (gate.py)."""
