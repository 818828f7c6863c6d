"""Hyperparameter search on Ray Tune over job configs (`petatrain tune`): each trial a petatrain run."""
