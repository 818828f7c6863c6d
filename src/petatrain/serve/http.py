"""The HTTP API's requests and answers, apart from Ray Serve: an OpenAI-style completions body is
checked field by field (a bad one is a `BadRequest`, HTTP 400, saying what to fix) and turned into
engine requests; a batch of completions becomes the response body."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from petatrain.serve.engine import Completion, Request

FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "user")
MAX_PROMPTS = 64
MAX_STOPS = 4


class BadRequest(ValueError):
    """What is wrong with a request, for its HTTP 400."""


def parse_completion(body: bytes, *, context: int, encode: Callable[[str], list[int]]) -> tuple[list[Request], bool]:
    """The engine requests of a `POST /v1/completions` body (one per prompt), and whether it asks for
    a stream; BadRequest otherwise."""
    try:
        fields = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise BadRequest('the body must be a JSON object, e.g. {"prompt": "Once", "max_tokens": 16}')
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, not {json.dumps(stream)[:40]}")
    prompts = _prompts(fields.get("prompt"))
    max_tokens = _int(fields, "max_tokens", 16, low=1)
    temperature = _number(fields, "temperature", 1.0, low=0.0, high=2.0)
    top_p = _number(fields, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise BadRequest("top_p 0 keeps no token; use a value in (0, 1], or temperature 0 for the likeliest token")
    seed = _int(fields, "seed", 0, low=0)
    stop = _stops(fields.get("stop"))
    requests = []
    for i, prompt in enumerate(prompts):
        ids = encode(prompt)
        where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        if not ids:
            raise BadRequest(f"{where} is empty: the model needs at least one token to continue")
        if len(ids) + max_tokens > context:
            raise BadRequest(
                f"{where} of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context of {context} "
                f"tokens; ask for at most {max(0, context - len(ids))} tokens or shorten the prompt"
            )
        requests.append(Request(tuple(ids), max_tokens, temperature, top_p, seed + i, stop))
    return requests, stream


def completion_body(model: str, request_id: str, done: list[Completion]) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in done)
    generated = sum(c.completion_tokens for c in done)
    return {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None} for i, c in enumerate(done)
        ],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }


def stream_events(model: str, request_id: str, pieces: Iterator[tuple[int, str, str | None]]) -> Iterator[str]:
    """Server-sent events of a streamed completion: a chunk per (prompt index, text, finish reason),
    then `data: [DONE]`, as OpenAI's API sends them."""
    created = int(time.time())
    for index, text, finish in pieces:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        chunk = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created, "model": model}
        yield f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n"
    yield "data: [DONE]\n\n"


def error_body(message: str, kind: str = "invalid_request_error", request_id: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": kind}
    if request_id:
        error["request_id"] = request_id
    return {"error": error}


def _prompts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        if len(value) > MAX_PROMPTS:
            raise BadRequest(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} a request")
        return value
    raise BadRequest("prompt must be a string or a non-empty list of strings")


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them")
    return tuple(stops)


def _int(fields: dict[str, Any], key: str, default: int, *, low: int) -> int:
    value = fields.get(key, default)
    if type(value) is not int or value < low:  # JSON's true is not a count
        raise BadRequest(f"{key} must be an integer >= {low}, not {json.dumps(value)[:40]}")
    return value


def _number(fields: dict[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = fields.get(key, default)
    if type(value) not in (int, float) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number in [{low:g}, {high:g}], not {json.dumps(value)[:40]}")
    return float(value)
