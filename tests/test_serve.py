"""petatrain serve: KV-cached generation, the request checks, and the Ray Serve application over HTTP."""

from __future__ import annotations

import torch

from petatrain.config import ModelConfig


class _Bytes:
    """A tokenizer of one id per byte (what the engine needs of `tokenizers.Tokenizer`)."""

    class _Encoding:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        return self._Encoding(list(text.encode()))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def _gpt(seed: int = 0):
    from petatrain.models import build_model

    torch.manual_seed(seed)
    cfg = ModelConfig(kind="gpt", n_layer=2, n_head=2, d_model=32, vocab_size=260, seq_len=48, dropout=0.0)
    return build_model(cfg).module.eval()


def _greedy_without_cache(model, ids: list[int], new: int) -> list[int]:
    out = torch.tensor(ids)
    for _ in range(new):
        out = torch.cat([out, model(out.unsqueeze(0))[0, -1].argmax().view(1)])
    return out[len(ids) :].tolist()


def test_kv_cached_generation_equals_recomputing_the_prefix():
    """Greedy, several prompts of different lengths decoded together: the same tokens as running
    the whole prefix through the model for every new token."""
    from petatrain.serve.engine import Engine, Request

    model = _gpt()
    engine = Engine(model, _Bytes())
    prompts = [[5, 9, 200], list(range(30, 50)), [7]]
    done = engine.complete([Request(ids=tuple(p), max_tokens=20, temperature=0) for p in prompts])
    for prompt, completion in zip(prompts, done, strict=True):
        assert completion.ids == _greedy_without_cache(model, prompt, 20)
        assert completion.finish_reason == "length" and completion.prompt_tokens == len(prompt)


def test_a_seed_samples_the_same_text_whatever_the_batch():
    from petatrain.serve.engine import Engine, Request

    engine = Engine(_gpt(), _Bytes())
    mine = Request(ids=(65, 66, 67), max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    others = [Request(ids=tuple(range(40, 40 + n)), max_tokens=24 - n, temperature=0.8, seed=n) for n in (2, 9, 17)]
    alone = engine.complete([mine])[0]
    for batch in ([*others, mine], [others[1], mine, others[0]]):
        together = next(c for r, c in zip(batch, engine.complete(batch), strict=True) if r is mine)
        assert together.ids == alone.ids
    assert engine.complete([Request(ids=(65, 66, 67), max_tokens=24, seed=8)])[0].ids != alone.ids


def test_top_p_keeps_the_smallest_head_of_the_distribution():
    from petatrain.serve.engine import sample

    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {sample(logits, 1.0, 0.7, torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {0, 1}
    assert sample(logits, 0.0, 1.0, torch.Generator()) == 0


def test_a_stop_string_ends_the_completion_before_it():
    from petatrain.serve.engine import Engine, Request

    engine = Engine(_gpt(), _Bytes())
    free = engine.complete([Request(ids=(65, 66), max_tokens=12, seed=3)])[0]
    k = next(k for k in range(1, len(free.text)) if free.text[k] not in free.text[:k])  # a first occurrence
    cut = engine.complete([Request(ids=(65, 66), max_tokens=12, seed=3, stop=(free.text[k],))])[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[:k]
