"""Completions from a GPT: prompts run into a KV cache one by one, then decoded together one token
per step, each row sampled with its own seeded generator. The decode step computes every row on its
own (models.gpt.rowwise), so a request's text for a seed is the same whatever else is in its batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt to complete (already checked: it and `max_tokens` fit the model's context)."""

    ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0  # 0: the most likely token, always
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class Completion:
    text: str
    finish_reason: str  # "length" | "stop" | "error"
    prompt_tokens: int
    completion_tokens: int
    ids: list[int] = field(default_factory=list)
    error: str = ""  # why this row failed ("" unless finish_reason is "error"); the batch's other rows go on


class Engine:
    """A model (a GPT with `new_cache`, `prefill`, `decode`) and its tokenizer."""

    def __init__(self, model: Any, tokenizer: Any, eos_id: int | None = None):
        self.model, self.tokenizer, self.eos_id = model.eval(), tokenizer, eos_id
        self.device = next(model.parameters()).device  # token ids go where the model is

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    @torch.no_grad()
    def complete(self, requests: list[Request]) -> list[Completion]:
        """Every request's completion; one forward of one position per generated token and row."""
        if not requests:
            return []
        model, device = self.model, self.device
        cache = model.new_cache(len(requests))
        logits = torch.stack(
            [model.prefill(torch.tensor(r.ids, device=device), cache, row) for row, r in enumerate(requests)]
        ).float()
        rows = [_Row(r) for r in requests]
        while True:
            host = logits.cpu()  # sampled on the host: one copy a step, not one per row
            tokens = [row.take(host[i], self) for i, row in enumerate(rows)]
            if all(row.done for row in rows):
                break
            frozen = torch.tensor([row.done for row in rows], device=device)
            logits = model.decode(torch.tensor(tokens, device=device), cache).float()
            cache.lengths -= frozen.long()  # a finished row stays where it is (its decode is discarded)
        return [row.result(self) for row in rows]

    @torch.no_grad()
    def stream(self, request: Request, counts: dict[str, int] | None = None) -> Iterator[tuple[str, str | None]]:
        """One request's completion as it is generated: (new text, None) per token whose text is
        whole, then ("", finish reason). The same tokens as `complete` gives it in any batch.
        `counts["completion_tokens"]` is increased by the tokens generated, once they are."""
        model, row, device = self.model, _Row(request), self.device
        cache = model.new_cache(1)
        logits = model.prefill(torch.tensor(request.ids, device=device), cache, 0)
        shown = ""
        while True:
            token = row.take(logits.float().cpu(), self)
            if row.error:
                raise RuntimeError(row.error)
            text = row.text if row.done and row.reason == "stop" and request.stop else self.tokenizer.decode(row.ids)
            # Held back: half a character, and what may be the start of a stop string
            end = len(text) if row.done else len(text) - max((len(s) - 1 for s in request.stop), default=0)
            if end > len(shown) and (row.done or not text[:end].endswith("\ufffd")):
                yield text[len(shown) : end], None
                shown = text[:end]
            if row.done:
                break
            logits = model.decode(torch.tensor([token], device=device), cache)[0]
        if counts is not None:
            counts["completion_tokens"] = counts.get("completion_tokens", 0) + len(row.ids)
        yield "", row.reason


class _Row:
    """One request's generation: its sampler, its tokens, whether it is finished and why."""

    def __init__(self, request: Request):
        self.request = request
        self.generator = torch.Generator().manual_seed(request.seed)
        self.ids: list[int] = []
        self.done = request.max_tokens == 0
        self.reason = "length"
        self.text = ""
        self.error = ""

    def take(self, logits: torch.Tensor, engine: Engine) -> int:
        """Sample the next token (0, not kept, once finished) and decide whether the row ends. A row
        whose sampling fails ends with its error; the batch's other rows go on."""
        if self.done:
            return 0
        try:
            token = sample(logits, self.request.temperature, self.request.top_p, self.generator)
        except (RuntimeError, ValueError) as exc:
            self.done, self.reason, self.error = True, "error", f"{type(exc).__name__}: {exc}"
            return 0
        if token == engine.eos_id:
            self.done, self.reason = True, "stop"
            return 0
        self.ids.append(token)
        if self.request.stop:
            text = engine.tokenizer.decode(self.ids)
            cut = min((i for i in (text.find(s) for s in self.request.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.done, self.reason, self.text = True, "stop", text[:cut]
                return token
        if len(self.ids) >= self.request.max_tokens:
            self.done = True
        return token

    def result(self, engine: Engine) -> Completion:
        text = self.text if self.reason == "stop" and self.request.stop else engine.tokenizer.decode(self.ids)
        return Completion(
            text=text, finish_reason=self.reason, prompt_tokens=len(self.request.ids),
            completion_tokens=len(self.ids), ids=list(self.ids), error=self.error,
        )  # fmt: skip


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """A token id from `logits` (vocab,): the most likely at temperature 0, else drawn from the
    softmax at `temperature`, keeping the most likely tokens whose probability adds up to `top_p`."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = (logits.double() / temperature).softmax(-1)
    if not torch.isfinite(probs).all():
        raise ValueError(f"the distribution at temperature {temperature:g} is not finite")
    if top_p < 1.0:
        ordered, order = probs.sort(descending=True)
        keep = ordered.cumsum(-1) - ordered < top_p  # the smallest head reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
