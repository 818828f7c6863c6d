"""The Ray Serve application: one deployment (`Completions`) whose replicas each load the run's
verified model and answer `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`
(and `/v1/models/NAME`) and `GET|HEAD /healthz`, as OpenAI's API and its official client expect.
Requests are batched (`@serve.batch`) and completed together by the engine, in a thread so the
replica keeps taking requests meanwhile; a request that fails fails alone."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from petatrain.config import ServeConfig
from petatrain.constants import SERVE_APP
from petatrain.serve import engine as engine_mod
from petatrain.serve import http
from petatrain.storage import StorageOptions

log = logging.getLogger(__name__)

APP = SERVE_APP


@dataclass(frozen=True, slots=True)
class ServeOptions:
    run_url: str
    checkpoint: str = "final"
    host: str = "127.0.0.1"
    port: int = 8000
    settings: ServeConfig = field(default_factory=ServeConfig)  # replicas, batching, autoscaling
    storage: StorageOptions | None = None
    follow: bool = False  # switch to each newly committed checkpoint (with checkpoint "latest")
    # registry://NAME@ALIAS|VERSION: serve the version the registry names (run_url and checkpoint are
    # its record's), verified against the record; with `follow`, switch whenever the alias moves.
    model_ref: str = ""
    registry: str = ""

    def __post_init__(self) -> None:
        from petatrain.errors import ConfigError

        if not 0 < self.port <= 65535:
            raise ConfigError(f"--port {self.port}: a TCP port is 1..65535")


@serve.deployment(name="completions")
class Completions:
    def __init__(self, options: ServeOptions):
        import torch

        torch.set_num_threads(max(1, int(options.settings.cpus_per_replica)))
        self.options = options
        self.name = options.run_url.rstrip("/").rsplit("/", 1)[-1]
        self.record: dict[str, Any] | None = None  # the registry version served (model_ref)
        self.fresh: dict[str, Any] | None = None  # its data's commit time and its first response's
        if options.model_ref:
            from petatrain.registry.store import Registry, parse_ref

            self.ref = parse_ref(options.model_ref)
            self.registry = Registry(options.registry, options.storage)
            self.name = str(self.ref.name)
        self.metrics = _Metrics(self.name)
        if options.model_ref:
            self._load_version(self.registry.resolve(self.ref))
        else:
            self._load(options.checkpoint)  # verified, or it raises and the replica never serves
        self.complete.set_max_batch_size(options.settings.max_batch)
        self.complete.set_batch_wait_timeout_s(options.settings.batch_wait_s)
        if options.follow:
            follow = self._follow_alias if options.model_ref else self._follow
            threading.Thread(target=follow, name="petatrain-follow", daemon=True).start()

    def _load(self, checkpoint: str, run: str = "", expect: str = "", about: dict[str, Any] | None = None) -> None:
        """The model at `checkpoint`, built aside and then put in place: a batch under way finishes on
        the engine it started with. `expect`: the checksum a registry record names (CorruptDataError
        when the weights are others). `about`: what else /v1/models says of it (a registry version's
        number, alias, lineage, data), put in place with it: a request never sees a card half-swapped."""
        from tokenizers import Tokenizer

        from petatrain.errors import CorruptDataError
        from petatrain.models import build_model
        from petatrain.train import weights

        served = weights.load(run or self.options.run_url, checkpoint, self.options.storage)
        if expect and served.checksum != expect:
            raise CorruptDataError(
                f"{run} ({checkpoint}): its weights ({served.checksum}) are not those the registry record "
                f"names ({expect})"
            )
        spec = build_model(served.config.model, served.config.train)
        spec.module.load_state_dict(served.weights, strict=False)  # tied names: both point at one tensor
        self.context = served.config.model.seq_len
        self.engine = engine_mod.Engine(spec.module, Tokenizer.from_str(served.tokenizer_json), served.eos_id)
        self.served = {**served.describe(), **(about or {})}
        self.metrics.serving(served.step, served.source)

    def _load_version(self, record: dict[str, Any]) -> None:
        """A registry version: its record verified (Registry.resolve), then its weights against it."""
        chain = record.get("lineage") or []
        data_version, committed = _data_commit(str(record.get("dataset") or ""), self.options.storage)
        about = {
            "data_version": data_version,
            "data_committed": committed,
            "staleness_s": None,  # the data's commit -> the first response of a model trained on it
            "version": record["version"],
            "alias": None if self.ref.selector.isdigit() else self.ref.selector,
            "lineage": [
                {k: link.get(k) for k in ("run_id", "how", "start_step", "step", "reads")} for link in chain[:10]
            ],
        }
        self._load(str(record["checkpoint"]), run=str(record["run"]), expect=str(record["checksum"]), about=about)
        self.record = record
        self.fresh = {"committed": committed, "first_served": None}  # reset at each swap
        self.metrics.versions(int(record["version"]), data_version)

    def _follow_alias(self) -> None:
        """Every `follow_poll_s`: the version the alias names; when it moved, that version's record and
        weights verified and swapped in. One that does not verify is skipped (and not tried again):
        the version served goes on serving."""
        from petatrain.errors import PetatrainError

        refused: set[int] = set()
        while True:
            time.sleep(self.options.settings.follow_poll_s)
            wanted = None
            try:
                moved = self.registry.alias(str(self.ref.name), self.ref.selector)
                wanted = int(moved["version"]) if moved else None
                if wanted is not None and wanted != self.served.get("version") and wanted not in refused:
                    self._load_version(self.registry.record(str(self.ref.name), wanted))
                    log.info("now serving %s version %d", self.name, wanted)
            except PetatrainError as exc:
                if wanted is not None:
                    refused.add(wanted)
                log.warning("not switching to %s version %s: %s", self.name, wanted, exc)
            except Exception:  # storage unreachable for a while: keep serving what is loaded
                log.warning("checking the registry failed", exc_info=True)

    def _follow(self) -> None:
        """Every `follow_poll_s`: the newest committed checkpoint past the one served, verified and
        swapped in; one that does not verify is skipped (and not tried again)."""
        from petatrain.errors import CorruptDataError
        from petatrain.train.checkpoint import committed_steps

        refused: set[int] = set()
        while True:
            time.sleep(self.options.settings.follow_poll_s)
            newer: list[int] = []
            try:
                steps = committed_steps(self.options.run_url, self.options.storage)
                newer = [s for s in steps if s > self.served["step"] and s not in refused]
                if newer:
                    self._load(str(max(newer)))
                    log.info("now serving step %d", self.served["step"])
            except CorruptDataError as exc:
                refused.add(max(newer))
                log.warning("not switching: %s", exc)
            except Exception:  # storage unreachable for a while: keep serving what is loaded
                log.warning("checking for new checkpoints failed", exc_info=True)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def complete(self, requests: list[engine_mod.Request]) -> list[engine_mod.Completion]:
        done = await asyncio.to_thread(self.engine.complete, requests)
        self.metrics.batch(len(requests), sum(c.completion_tokens for c in done))
        return done

    async def __call__(self, request: Request) -> Response:
        t0 = time.perf_counter()
        response = await self._route(request)
        self.metrics.answered(request.url.path, response.status_code, time.perf_counter() - t0)
        return response

    async def _route(self, request: Request) -> Response:
        path, method = request.url.path.rstrip("/") or "/", request.method
        request_id = uuid.uuid4().hex[:12]
        try:
            if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
                body = await self._body(request)
                return await self._completions(body, request_id, chat=path == "/v1/chat/completions")
            if path == "/v1/models" and method == "GET":
                return JSONResponse({"object": "list", "data": [self._card()]})
            if path.startswith("/v1/models/") and method == "GET":
                if path.removeprefix("/v1/models/") != self.name:
                    raise http.BadRequest(
                        f"the model {path.removeprefix('/v1/models/')[:80]!r} does not exist here: this server "
                        f"serves {self.name!r}", "model", "model_not_found", status=404,
                    )  # fmt: skip
                return JSONResponse(self._card())
            if path == "/healthz" and method in ("GET", "HEAD"):  # load balancers probe with HEAD
                return PlainTextResponse("ok")
            known = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /healthz"
            return JSONResponse(http.error_body(f"no route {method} {path} ({known})", code="not_found"), 404)
        except http.BadRequest as exc:
            return JSONResponse(http.error_body(str(exc), param=exc.param, code=exc.code), status_code=exc.status)
        except Exception as exc:  # one line in the log; the traceback only at debug level
            log.warning("request %s failed: %s: %s", request_id, type(exc).__name__, str(exc)[:200])
            log.debug("request %s failed", request_id, exc_info=True)
            failure = http.error_body(
                "the model failed on this request; see the replica's log", "server_error", request_id
            )
            return JSONResponse(failure, status_code=500)

    def _card(self) -> dict[str, Any]:
        """What /v1/models says of the model: its name and what is served, not where it lies."""
        served = {k: v for k, v in self.served.items() if k != "run"}
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "petatrain", **served}

    async def _body(self, request: Request) -> bytes:
        """The request's body, at most `serve.max_request_bytes` (HTTP 413 beyond) and read within
        `serve.request_timeout_s` (HTTP 408 after): a client sending a body slowly, or a huge one,
        must not hold a slot the others need."""
        limit, deadline = self.options.settings.max_request_bytes, self.options.settings.request_timeout_s
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise http.BadRequest(
                f"the body is {declared} bytes; at most {limit} a request", code="too_large", status=413
            )
        chunks: list[bytes] = []
        size = 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise http.BadRequest(f"the body is over {limit} bytes", code="too_large", status=413)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), timeout=deadline)
        except TimeoutError:
            raise http.BadRequest(f"the body took over {deadline:g} s to arrive", code="timeout", status=408) from None
        return b"".join(chunks)

    async def _completions(self, body: bytes, request_id: str, *, chat: bool = False) -> Response:
        parse = http.parse_chat if chat else http.parse_completion
        wanted, stream, usage = parse(body, context=self.context, encode=self.engine.encode, model=self.name)
        if stream:  # token by token, on Starlette's thread pool (a sync iterator), outside the batches
            counts = {"prompt_tokens": sum(len(r.ids) for r in wanted), "completion_tokens": 0}

            def pieces():
                for i, r in enumerate(wanted):
                    for text, finish in self.engine.stream(r, counts):
                        yield i, text, finish

            def totals() -> dict[str, int]:
                return {**counts, "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}

            events = http.stream_events(self.name, request_id, pieces(), chat=chat, usage=totals if usage else None)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await asyncio.gather(*(self.complete(r) for r in wanted))  # each prompt joins a batch
        failed = [c.error for c in done if c.error]
        if failed:  # this request's own rows failed; the others in their batches were answered
            log.warning("request %s: %d of its prompt(s) failed: %s", request_id, len(failed), failed[0][:200])
            failure = http.error_body(
                "the model failed on this request; see the replica's log", "server_error", request_id
            )
            return JSONResponse(failure, status_code=500)
        build = http.chat_body if chat else http.completion_body
        self._first_response()
        return JSONResponse(build(self.name, request_id, list(done)))

    def _first_response(self) -> None:
        """Model staleness, once per version served: from its data's commit to this, its first answer."""
        from petatrain.data.manifest import epoch

        fresh = self.fresh
        if fresh is None or fresh["first_served"] is not None or not fresh["committed"]:
            return
        now = fresh["first_served"] = time.time()
        staleness = round(now - (epoch(fresh["committed"]) or now), 3)
        self.served = {**self.served, "staleness_s": staleness}
        self.metrics.staleness(staleness)


class _Metrics:
    """A replica's series on Ray's metrics endpoint (each node's, `ray_` prefixed): requests by route
    and status, their latency, completion tokens, batch sizes, and the step being served."""

    ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/healthz")

    def __init__(self, model: str):
        from ray.util import metrics

        self.model = model
        self.requests = metrics.Counter(
            "petatrain_serve_requests", description="HTTP requests answered", tag_keys=("route", "status")
        )
        self.latency = metrics.Histogram(
            "petatrain_serve_latency_seconds", description="Time to answer a request",
            boundaries=[0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30], tag_keys=("route",),
        )  # fmt: skip
        self.tokens = metrics.Counter("petatrain_serve_completion_tokens", description="Tokens generated")
        self.batch_size = metrics.Histogram(
            "petatrain_serve_batch_size", description="Requests completed together",
            boundaries=[1, 2, 4, 8, 16, 32, 64],
        )  # fmt: skip
        self.step = metrics.Gauge(
            "petatrain_serve_checkpoint_step", description="Step of the weights served", tag_keys=("model", "source")
        )
        self.model_version = metrics.Gauge(
            "petatrain_serve_model_version", description="Registry version served", tag_keys=("model",)
        )
        self.data_version = metrics.Gauge(
            "petatrain_serve_data_version",
            description="Dataset version the served model was trained on (its newest)",
            tag_keys=("model",),
        )
        self.stale = metrics.Gauge(
            "petatrain_model_staleness_seconds",
            description="From the commit of the served model's newest data to its first response",
            tag_keys=("model",),
        )

    def versions(self, model_version: int, data_version: int | None) -> None:
        self.model_version.set(model_version, tags={"model": self.model})
        if data_version is not None:
            self.data_version.set(data_version, tags={"model": self.model})

    def staleness(self, seconds: float) -> None:
        self.stale.set(seconds, tags={"model": self.model})

    def serving(self, step: int, source: str) -> None:
        self.step.set(step, tags={"model": self.model, "source": source})

    def answered(self, path: str, status: int, seconds: float) -> None:
        route = path.rstrip("/") if path.rstrip("/") in self.ROUTES else "other"
        self.requests.inc(tags={"route": route, "status": str(status)})
        self.latency.observe(seconds, tags={"route": route})

    def batch(self, size: int, tokens: int) -> None:
        self.batch_size.observe(size)
        if tokens:
            self.tokens.inc(tokens)


def _data_commit(dataset: str, options: StorageOptions | None) -> tuple[int | None, str | None]:
    """(version, commit time) of the dataset version a registry record names (DATASET@vN); Nones when
    it names none or its event cannot be read: staleness is then not measured, nothing else changes."""
    from petatrain.data import commit_log
    from petatrain.data.index import split_version

    root, version = split_version(dataset)
    if version is None:
        return None, None
    try:
        events = commit_log.read(root, after=version - 1, options=options)
    except Exception:  # storage unreachable, a damaged log: serving goes on
        log.warning("the commit of %s could not be read: staleness is not measured", dataset, exc_info=True)
        return version, None
    committed = events[0].get("committed") if events and events[0].get("version") == version else None
    return version, committed


def check_fits(settings: ServeConfig, cpus: float) -> None:
    """ConfigError (one line) for replicas the cluster cannot hold: Serve would wait for them forever."""
    from petatrain.errors import ConfigError

    low, _ = settings.replica_range()
    need = low * settings.cpus_per_replica
    if need > cpus:
        raise ConfigError(
            f"serve.replicas {settings.replicas} x serve.cpus_per_replica {settings.cpus_per_replica:g} "
            f"need {need:.12g} CPUs at least; the cluster has {cpus:g}"
        )


def start(options: ServeOptions) -> str:
    """Deploy on the connected Ray cluster and return the URL; returns once the replicas answer."""
    import ray

    from petatrain.console import ray_output_to_console

    check_fits(options.settings, ray.cluster_resources().get("CPU", 0.0))

    if not ray_output_to_console():  # Serve's own lines stay in Ray's logs unless --verbose
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(http_options={"host": options.host, "port": options.port})
    deployment: Any = Completions  # a serve.Deployment once decorated
    app = deployment.options(**options.settings.deployment_options()).bind(options)
    serve.run(app, name=APP, route_prefix="/")
    return f"http://{options.host}:{options.port}"


def build_app(args: dict[str, Any]) -> Any:
    """The application builder a RayService's `serveConfigV2` names (`petatrain.serve.app:build_app`,
    args `run` and `checkpoint`, or `run: registry://NAME@ALIAS` with `registry` and `follow`); its
    deployment's replicas and autoscaling come from that config."""
    if not isinstance(args, dict) or not args.get("run"):
        raise ValueError(
            "petatrain.serve.app:build_app needs args: {run: RUN_URL, checkpoint: final|latest|STEP} or "
            "{run: registry://NAME@ALIAS, registry: URL, follow: true}"
        )
    run = str(args["run"])
    if run.startswith("registry://"):
        from petatrain.registry.store import Registry, parse_ref

        store = Registry(str(args.get("registry") or "") or None)
        record = store.resolve(parse_ref(run))  # verified, or the application does not start
        options = ServeOptions(
            run_url=str(record["run"]), checkpoint=str(record["checkpoint"]), follow=bool(args.get("follow")),
            model_ref=run, registry=store.url,
        )  # fmt: skip
        deployment: Any = Completions
        return deployment.bind(options)
    checkpoint = str(args.get("checkpoint", "final"))
    options = ServeOptions(run_url=run, checkpoint=checkpoint, follow=checkpoint == "latest")
    plain: Any = Completions
    return plain.bind(options)


def stop() -> None:
    serve.delete(APP)
    serve.shutdown()
