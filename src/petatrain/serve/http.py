"""The HTTP API's requests and answers, apart from Ray Serve: an OpenAI-style completions or chat
completions body is checked field by field (a bad one is a `BadRequest`, HTTP 400 with OpenAI's
error object, saying what to fix) and turned into engine requests; a batch of completions becomes
the response body. What one request may cost is bounded here: JSON depth, number size, seeds,
temperatures that would overflow, prompts, stops."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

from petatrain.serve.engine import Completion, Request

FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "user")
# OpenAI fields petatrain does not implement: accepted at the value that changes nothing (what
# clients such as LangChain and evaluation harnesses send whatever they want), refused otherwise.
DEFAULTS: dict[str, Any] = {
    "n": (1,),
    "best_of": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logprobs": (None,),
    "top_logprobs": (None,),
    "echo": (False,),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "stream_options": (None,),
    "service_tier": (None, "auto", "default"),
    "parallel_tool_calls": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
}
MAX_PROMPTS = 64
MAX_STOPS = 4
MAX_SEED = 2**63 - 1 - MAX_PROMPTS  # a prompt's generator is seeded with seed + its index
# Below this a temperature is greedy decoding, as vLLM takes it: dividing the logits by a smaller
# one overflows (1e-310 made inf, then NaN, and failed the whole batch).
GREEDY_BELOW = 1e-5
MAX_JSON_DEPTH = 32


class BadRequest(ValueError):
    """What is wrong with a request, for its HTTP 400 (`param`: the field, `code`: OpenAI's code)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def parse_json(body: bytes) -> Any:
    """The request body's JSON; BadRequest for anything else: not JSON, not UTF-8, nested deeper than
    any request needs, a number too long to convert, a lone surrogate in a string."""
    try:
        fields = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
    except RecursionError:
        raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise BadRequest(f"the body is not JSON a request can hold ({exc})") from None
    _check_depth(fields, MAX_JSON_DEPTH)
    return fields


def _check_depth(value: Any, left: int) -> None:
    if left < 0:
        raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, dict):
        for item in value.values():
            _check_depth(item, left - 1)
    elif isinstance(value, list):
        for item in value:
            _check_depth(item, left - 1)


def parse_completion(
    body: bytes, *, context: int, encode: Callable[[str], list[int]], model: str | None = None
) -> tuple[list[Request], bool, bool]:
    """The engine requests of a `POST /v1/completions` body (one per prompt), whether it asks for a
    stream, and whether the stream ends with the usage (`stream_options.include_usage`); BadRequest
    otherwise. `model`: the served model's name (another name is 404 model_not_found)."""
    fields = _object(parse_json(body), 'e.g. {"prompt": "Once", "max_tokens": 16}')
    return _requests(fields, _prompts(fields.get("prompt")), FIELDS, context=context, encode=encode, model=model)


def parse_chat(
    body: bytes, *, context: int, encode: Callable[[str], list[int]], model: str | None = None
) -> tuple[list[Request], bool, bool]:
    """The same for a `POST /v1/chat/completions` body: its messages put into one prompt by
    `chat_prompt` (a base model has no chat template of its own)."""
    fields = _object(parse_json(body), 'e.g. {"messages": [{"role": "user", "content": "Hello"}]}')
    names = (*(f for f in FIELDS if f != "prompt"), "messages", "max_completion_tokens")
    if "max_completion_tokens" in fields and "max_tokens" not in fields:
        fields = {**fields, "max_tokens": fields["max_completion_tokens"]}
    return _requests(fields, [chat_prompt(fields.get("messages"))], names, context=context, encode=encode, model=model)


def chat_prompt(messages: Any) -> str:
    """Messages as one plain-text prompt: "role: content" lines, then "assistant:" for the reply."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant"):
            raise BadRequest(f"messages[{i}] needs a role: system, developer, user or assistant", "messages")
        content = message.get("content")
        if isinstance(content, list):  # OpenAI's content parts: the text ones
            parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            texts = [p for p in parts if isinstance(p, str)]
            if len(texts) != len(content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(texts)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        lines.append(f"{message['role']}: {content}")
    return "\n".join(lines) + "\nassistant:"


def _object(fields: Any, example: str) -> dict[str, Any]:
    if not isinstance(fields, dict):
        raise BadRequest(f"the body must be a JSON object, {example}")
    return fields


def _requests(
    fields: dict[str, Any],
    prompts: list[str],
    names: tuple[str, ...],
    *,
    context: int,
    encode: Callable[[str], list[int]],
    model: str | None,
) -> tuple[list[Request], bool, bool]:
    unknown = sorted(set(fields) - set(names) - set(DEFAULTS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r} (fields: {', '.join(names)})", unknown[0])
    if model is not None and fields.get("model") not in (None, model):
        raise BadRequest(
            f"the model {str(fields['model'])[:80]!r} does not exist here: this server serves {model!r}",
            "model", "model_not_found", status=404,
        )  # fmt: skip
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be true or false, not {json.dumps(stream)[:40]}", "stream")
    usage = _stream_options(fields.get("stream_options"), stream)
    for name, accepted in DEFAULTS.items():
        if name != "stream_options" and name in fields and fields[name] not in accepted:
            raise BadRequest(
                f"{name} {json.dumps(fields[name])[:40]} is not supported (only {json.dumps(accepted[0])})",
                name, "unsupported_value",
            )  # fmt: skip
    max_tokens = _int(fields, "max_tokens", 16, low=1)
    temperature = _number(fields, "temperature", 1.0, low=0.0, high=2.0)
    top_p = _number(fields, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise BadRequest(
            "top_p 0 keeps no token; use a value in (0, 1], or temperature 0 for the likeliest token", "top_p"
        )
    seed = _int(fields, "seed", 0, low=0, high=MAX_SEED)
    stop = _stops(fields.get("stop"))
    requests = []
    for i, prompt in enumerate(prompts):
        where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{where} is not valid Unicode (a lone surrogate)", "prompt") from None
        ids = encode(prompt)
        if not ids:
            raise BadRequest(f"{where} is empty: the model needs at least one token to continue", "prompt")
        if len(ids) + max_tokens > context:
            raise BadRequest(
                f"{where} of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context of {context} "
                f"tokens; ask for at most {max(0, context - len(ids))} tokens or shorten the prompt",
                "max_tokens", "context_length_exceeded",
            )  # fmt: skip
        greedy = 0.0 if temperature < GREEDY_BELOW else temperature
        requests.append(Request(tuple(ids), max_tokens, greedy, top_p, seed + i, stop))
    return requests, stream, usage


def _stream_options(value: Any, stream: bool) -> bool:
    """Whether a stream ends with a chunk holding the usage (`stream_options: {include_usage: true}`)."""
    if value is None:
        return False
    if not stream:
        raise BadRequest("stream_options is only for stream: true", "stream_options")
    if not isinstance(value, dict) or set(value) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest('stream_options holds {"include_usage": true|false} only', "stream_options")
    include = value.get("include_usage", False)
    if not isinstance(include, bool) or value.get("continuous_usage_stats", False) is not False:
        raise BadRequest("stream_options.include_usage must be true or false", "stream_options")
    return include


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


def chat_body(model: str, request_id: str, done: list[Completion]) -> dict[str, Any]:
    body = completion_body(model, request_id, done)
    body["id"], body["object"] = f"chatcmpl-{request_id}", "chat.completion"
    body["choices"] = [
        {"index": i, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
         "logprobs": None}
        for i, c in enumerate(done)
    ]  # fmt: skip
    return body


def stream_events(
    model: str,
    request_id: str,
    pieces: Iterator[tuple[int, str, str | None]],
    *,
    chat: bool = False,
    usage: Callable[[], dict[str, int]] | None = None,
) -> Iterator[str]:
    """Server-sent events of a streamed completion: a chunk per (prompt index, text, finish reason),
    with `usage` a last chunk holding the token counts and no choices, then `data: [DONE]`, as
    OpenAI's API sends them (chat: `chat.completion.chunk`, the text as each choice's `delta`)."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "object": kind, "created": created, "model": model}
    started: set[int] = set()
    for index, text, finish in pieces:
        if chat:
            delta = {"content": text} if index in started else {"role": "assistant", "content": text}
            started.add(index)
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
    if usage is not None:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage()})}\n\n"
    yield "data: [DONE]\n\n"


def error_body(
    message: str,
    kind: str = "invalid_request_error",
    request_id: str | None = None,
    *,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error object: message, type, param, code (and petatrain's request id on a 500)."""
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": code}
    if request_id:
        error["request_id"] = request_id
    return {"error": error}


def _prompts(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        if len(value) > MAX_PROMPTS:
            raise BadRequest(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} a request", "prompt")
        return value
    raise BadRequest("prompt must be a string or a non-empty list of strings (token ids are not taken)", "prompt")


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise BadRequest(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return tuple(stops)


def _int(fields: dict[str, Any], key: str, default: int, *, low: int, high: int | None = None) -> int:
    value = fields.get(key, default)
    if value is None:
        return default
    if type(value) is not int or value < low or (high is not None and value > high):  # JSON's true is not a count
        within = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"{key} must be an integer {within}, not {json.dumps(value)[:40]}", key)
    return value


def _number(fields: dict[str, Any], key: str, default: float, *, low: float, high: float) -> float:
    value = fields.get(key, default)
    if value is None:
        return default
    if type(value) not in (int, float) or not low <= value <= high:
        raise BadRequest(f"{key} must be a number in [{low:g}, {high:g}], not {json.dumps(value)[:40]}", key)
    return float(value)
