from petatrain.cli import app

app()
