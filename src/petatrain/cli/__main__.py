"""`python -m petatrain.cli`, as when the CLI was one module (`python -m petatrain` is the same)."""

from petatrain.cli import app

app()
