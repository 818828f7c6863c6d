"""Fault injectors used by tests, benchmarks and `petatrain chaos`."""
