"""Sample text from a trained GPT's final weights (the demo's last lines)."""

from __future__ import annotations

import torch

from petatrain.config import JobConfig
from petatrain.models import build_model
from petatrain.models.gpt import generate
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import read_bytes
from petatrain.train.checkpoint.final import read_final


def sample_text(
    cfg: JobConfig, run_url: str, *, prompts: list[str], new_tokens: int = 80, options: StorageOptions | None = None
) -> list[str]:
    """Continue each prompt with the run's final weights (verified, decrypted), decoded by the
    dataset's tokenizer."""
    from tokenizers import Tokenizer

    from petatrain.data.index import split_version

    dataset = split_version(cfg.data.dataset)[0]
    tok = Tokenizer.from_str(read_bytes(join(dataset, "_index", "tokenizer.json"), options).decode())
    spec = build_model(cfg.model, cfg.train)
    spec.module.load_state_dict(read_final(run_url, options)[0])
    spec.module.eval()
    texts = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(tok.encode(prompt, add_special_tokens=False).ids, dtype=torch.long)
        out = generate(spec.module, ids, new_tokens, seed=i)
        texts.append(tok.decode(out.tolist()))
    return texts
