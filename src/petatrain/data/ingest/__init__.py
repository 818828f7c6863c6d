"""The ingest pipeline: raw files -> a clean, deduplicated, sharded dataset, on Ray. `pipeline` runs it
and commits (`run(IngestJob) -> IngestSummary`, with `job` holding both); `stages` holds the Ray
task bodies, `split` cuts large files into pieces, `clean`, `dedup` with `minhash`, and `tokenize` are
its steps, `register` adopts a folder of Parquet files as a dataset. It reads raw files through
`petatrain.data.readers` and writes the dataset the top-level `petatrain.data` modules describe.

`run` is imported lazily: the pipeline imports Ray, which the Ray-free users of `stages` (the GPU
check) must not pull in.
"""

from typing import TYPE_CHECKING, Any

from petatrain.data.ingest.job import IngestJob, IngestSummary

if TYPE_CHECKING:
    from petatrain.data.ingest.pipeline import run

__all__ = ["IngestJob", "IngestSummary", "run"]


def __getattr__(name: str) -> Any:
    if name == "run":
        from petatrain.data.ingest import pipeline

        return pipeline.run
    raise AttributeError(f"module 'petatrain.data.ingest' has no attribute {name!r}")
