"""Serving a trained GPT: requests/s, completion tokens/s and p50/p99 latency at concurrency 1, 8
and 32, side by side in one run, and the time from starting a server to its first answer.

Contestants, each serving the same weights on 127.0.0.1 and answering POST /v1/completions:
1. petatrain serve, batching on (--max-batch 16) and off (--max-batch 1): KV cache, verified weights;
2. a plain Ray Serve deployment of the same model: no batching, no KV cache (every token recomputes
   the prefix, as train/sample.py's `generate` does);
3. a single FastAPI/uvicorn process, no Ray: the same generation as 2.

The load is a fixed mix of prompts, 32 new tokens each (no stop strings), sent by threads of
`requests` clients on this machine (on 2 cores they share the CPU with the server: the same for all).

    .venv/bin/python benchmarks/serve.py [--requests-per-client 6]

Prints a table and writes benchmarks/results/serve.json with the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from _common import WORK, write_results  # benchmarks/ is not a package
from petatrain import api, config
from recovery import dataset

PROMPTS = ["Once upon a time", "The", "In a land far away there lived a", "data and", "She said that the"]
NEW_TOKENS = 32
CONCURRENCY = (1, 8, 32)

# The plain generation of contestants 2 and 3: the whole prefix through the model for every token.
PLAIN = """
import json, torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from petatrain import config
from petatrain.models import build_model

def load(run):
    cfg = config.from_yaml(open(f"{run}/config.yaml").read(), "config.yaml")
    spec = build_model(cfg.model, cfg.train)
    spec.module.load_state_dict(load_file(f"{run}/final/model.safetensors"))
    tok = Tokenizer.from_str(open(f"{cfg.data.dataset}/_index/tokenizer.json").read())
    return spec.module.eval(), tok, cfg.model.seq_len

@torch.no_grad()
def complete(model, tok, seq_len, body):
    ids = torch.tensor(tok.encode(body["prompt"], add_special_tokens=False).ids)
    gen = torch.Generator().manual_seed(body.get("seed", 0))
    for _ in range(body["max_tokens"]):
        logits = model(ids[-seq_len:].unsqueeze(0))[0, -1].double() / body.get("temperature", 1.0)
        ids = torch.cat([ids, torch.multinomial(logits.softmax(-1), 1, generator=gen)])
    text = tok.decode(ids[-body["max_tokens"]:].tolist())
    return {"choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"completion_tokens": body["max_tokens"]}}
"""

FASTAPI = (
    PLAIN
    + """
import sys, uvicorn
from fastapi import FastAPI, Request
torch.set_num_threads(1)
model, tok, seq_len = load(sys.argv[1])
app = FastAPI()

@app.post("/v1/completions")
async def completions(request: Request):
    return complete(model, tok, seq_len, await request.json())

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trained_run() -> str:
    """A 4-block GPT trained on the byte-token dataset, once (benchmarks/.work/serve-run)."""
    run = WORK / "serve-run"
    if not (run / "final" / "COMMITTED").exists():
        cfg = config.load(
            None,
            [f"data.dataset={dataset()}", "train.steps=60", "model.n_layer=4", "model.d_model=64", "model.n_head=2",
             "model.seq_len=64", "model.vocab_size=320", "train.global_batch=16", "train.micro_batch=8",
             "train.eval_every=0", "parallel.workers=2"],
        )  # fmt: skip
        with contextlib.suppress(FileNotFoundError):
            import shutil

            shutil.rmtree(run)
        api.train(cfg, run_dir=str(run))
    return str(run)


@contextlib.contextmanager
def petatrain_server(run: str, max_batch: int) -> Iterator[str]:
    serving = api.serve(run, port=free_port(), overrides=[f"serve.max_batch={max_batch}"])
    try:
        yield serving.url
    finally:
        api.stop_serving()


@contextlib.contextmanager
def plain_ray_server(run: str) -> Iterator[str]:
    from ray import serve
    from starlette.requests import Request

    namespace: dict = {}
    exec(PLAIN, namespace)  # the plain generation, defined once for both plain contestants

    @serve.deployment(ray_actor_options={"num_cpus": 1})
    class Plain:
        def __init__(self, run: str):
            import torch

            torch.set_num_threads(1)
            self.model, self.tok, self.seq_len = namespace["load"](run)

        async def __call__(self, request: Request) -> dict:
            return namespace["complete"](self.model, self.tok, self.seq_len, await request.json())

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Plain.bind(run), name="plain", route_prefix="/v1/completions")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.delete("plain")
        serve.shutdown()


@contextlib.contextmanager
def fastapi_server(run: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FASTAPI, run, str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.ConnectionError):
                ask(url, 0)
                break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ask(url: str, i: int, session: requests.Session | None = None) -> tuple[float, int]:
    """(seconds, completion tokens) of one request."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": NEW_TOKENS, "seed": i, "temperature": 1.0}
    t0 = time.perf_counter()
    reply = (session or requests).post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - t0, int(reply.json()["usage"]["completion_tokens"])


def load(url: str, clients: int, per_client: int) -> dict:
    """`clients` threads sending `per_client` requests each, back to back."""

    def client(c: int) -> list[tuple[float, int]]:
        with requests.Session() as session:
            return [ask(url, c * per_client + k, session) for k in range(per_client)]

    ask(url, 0)  # warm
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    latency = sorted(s for s, _ in results)
    return {
        "requests": len(results),
        "requests_per_s": len(results) / wall,
        "tokens_per_s": sum(n for _, n in results) / wall,
        "p50_s": statistics.median(latency),
        "p99_s": latency[min(len(latency) - 1, int(0.99 * len(latency)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests-per-client", type=int, default=6)
    args = parser.parse_args()
    run = trained_run()
    from petatrain.runtime.cluster import init_ray

    init_ray("")
    contestants = {
        "petatrain (batching)": lambda: petatrain_server(run, 16),
        "petatrain (no batching)": lambda: petatrain_server(run, 1),
        "plain Ray Serve": lambda: plain_ray_server(run),
        "FastAPI/uvicorn": lambda: fastapi_server(run),
    }
    rows: dict[str, dict] = {}
    for name, start in contestants.items():
        t0 = time.perf_counter()
        with start() as url:
            ask(url, 0)
            rows[name] = {"cold_start_s": time.perf_counter() - t0}
            for clients in CONCURRENCY:
                per_client = max(2, args.requests_per_client * 8 // max(clients, 8)) if clients > 1 else 8
                rows[name][f"c{clients}"] = load(url, clients, per_client)
                r = rows[name][f"c{clients}"]
                print(
                    f"{name:24s} c={clients:2d}  {r['requests_per_s']:6.2f} req/s  {r['tokens_per_s']:7.1f} tok/s  "
                    f"p50 {1e3 * r['p50_s']:7.1f} ms  p99 {1e3 * r['p99_s']:7.1f} ms",
                    flush=True,
                )
    base = rows["plain Ray Serve"]
    print(f"\n{'':24s} " + "  ".join(f"c={c}: req/s vs plain Ray Serve" for c in CONCURRENCY) + "   cold start")
    for name, row in rows.items():
        ratios = "  ".join(
            f"{row[f'c{c}']['requests_per_s'] / base[f'c{c}']['requests_per_s']:27.2f}x" for c in CONCURRENCY
        )
        print(f"{name:24s} {ratios}   {row['cold_start_s']:.1f} s")
    write_results("serve", {"new_tokens": NEW_TOKENS, "prompts": PROMPTS, "run": Path(run).name, "rows": rows})


if __name__ == "__main__":
    main()
