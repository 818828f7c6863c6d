"""Data layer: ingest (raw files -> dataset) and the streaming loader (dataset -> batches).

The top-level modules are the dataset on storage, which both sides share: `manifest`, `index`
(shard index, checks, versions `DATASET@vN`), `lineage`, `card`, `partitions`, `buffers`, `inspect`
and `synth`. `readers/` parses raw input files, one module per format; `ingest/` turns them into a
dataset; `loading/` streams a dataset to training ranks. Imports flow one way: readers <- ingest,
and neither ingest nor loading imports the other. `job.py` and `elastic_demo.py` here are
compatibility re-exports of their new paths for api.py and runtime/ (to be removed).

`StreamingDataset` and `loader` are imported lazily: they pull in torch, which Ray
ingest workers do not need.
"""

from typing import Any

__all__ = ["StreamingDataset", "StreamingLoader", "loader"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from petatrain.data.loading import stream

        return getattr(stream, name)
    raise AttributeError(f"module 'petatrain.data' has no attribute {name!r}")
