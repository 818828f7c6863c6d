"""petatrain: ingest, stream and train on petabyte-scale data with Ray and PyTorch."""

__version__ = "0.1.0"
