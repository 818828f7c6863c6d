"""The loader: a dataset on storage -> samples and batches for training ranks. `stream` holds
`StreamingDataset` and the DataLoader wrappers (`StreamingLoader`, `loader`), `order` the
deterministic, resumable sample order dealt out to ranks and workers (`SampleOrder`), `cache` the
node-local shard cache (`ShardCache`), and `elastic_demo` the loader's promise shown on a dataset
(stop with N ranks, resume with M). It reads only what `petatrain.data` top-level modules describe
(manifest, shard index, partitions) and never imports ingest. Named `loading`, not `loader`:
`petatrain.data.loader` is the public function, which a subpackage of that name would shadow.
"""
