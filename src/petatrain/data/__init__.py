"""Data layer: ingest (raw files -> dataset) and the streaming loader (dataset -> batches).

`StreamingDataset` and `loader` are imported lazily: they pull in torch, which Ray
ingest workers do not need.
"""

from typing import Any

__all__ = ["StreamingDataset", "StreamingLoader", "loader"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from petatrain.data import stream

        return getattr(stream, name)
    raise AttributeError(f"module 'petatrain.data' has no attribute {name!r}")
