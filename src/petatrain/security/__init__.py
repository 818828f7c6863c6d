"""What protects the data and the weights, below the storage that carries them: keys (a keyring
file or an OpenStack Barbican container), sealed files (AES-GCM in chunks), Parquet's modular
encryption, signatures of manifests and checkpoints, and the per-role S3 access policies.

Nothing here reaches an object store: these modules take a job's `Protection` (protection.py: the
key references, how strictly signatures are checked, a key service's credentials), or options that
carry one, and bytes or local files, so `storage/` may call them."""
