"""`petatrain serve`: a trained run's model behind Ray Serve (weights verified against what the run
committed, the dataset's tokenizer, KV-cached generation, dynamic batching)."""
