"""The job config's schema: one small dataclass per component, composed into `JobConfig`, each
checking its own values (`__post_init__`, one line naming the key); what a continuing run may
change (`RESUMABLE`). Reading YAML and `--set` overrides into these is `config/loading.py`."""

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from petatrain.config.values import parse_size
from petatrain.errors import ConfigError
from petatrain.security.keys import check_keyref
from petatrain.security.protection import Protection
from petatrain.storage.fs import StorageOptions
from petatrain.storage.sse import ServerSideEncryption

DedupMode = Literal["none", "exact", "near"]
SourceFormat = Literal["auto", "jsonl", "parquet", "csv", "text", "webdataset", "tfrecord"]


@dataclass(kw_only=True, slots=True)
class IngestConfig:
    """How raw files become a dataset."""

    # Each field is also a flag of `petatrain ingest` (--text-field for text_field): its `help` metadata
    # is the flag's help (a Literal's values when it has none), `default_help` says what an empty default means.

    format: SourceFormat = "auto"
    text_field: str = field(
        default="text", metadata={"help": "Field (column, member extension, TFRecord feature) holding the text."}
    )
    dedup: DedupMode = "near"
    near_threshold: float = field(
        default=0.8, metadata={"help": "Jaccard similarity over word 5-grams that counts as a near duplicate."}
    )
    tokenizer: str = field(  # "" (no tokens), "bytes", "train:VOCAB" or a tokenizer.json path
        default="", metadata={"help": "bytes | train:VOCAB | path/to/tokenizer.json", "default_help": "keep text only"}
    )
    pack_length: int = field(  # 0 keeps one row per document; L packs tokens into L-token rows
        default=0, metadata={"help": "Pack tokens into rows of this many tokens (0: no)."}
    )
    shard_size: str = field(default="256MB", metadata={"help": "Target shard size, e.g. 256MB."})
    # A JSONL, text or unquoted CSV file larger than this is read as pieces of about this size in
    # parallel, cut at record boundaries; "0" reads every file whole. Ids do not depend on it.
    split_size: str = field(
        default="256MB",
        metadata={"help": "Read JSONL, text and unquoted CSV files over this size as pieces in parallel; 0: never."},
    )
    max_chars: int = field(default=1_000_000, metadata={"help": "Reject records longer than this."})
    min_chars: int = field(default=1, metadata={"help": "Reject records shorter than this."})
    # The source fields kept beside the text, as columns: "*" every one, "a,b" those, "" none.
    fields: str = field(
        default="*",
        metadata={"help": "Source fields kept as columns beside the text: a,b (those), * (every one), '' (none)."},
    )
    drop_fields: str = field(  # "c,d": every field but these
        default="", metadata={"help": "Source fields not kept: c,d (every other one is)."}
    )

    def __post_init__(self) -> None:
        if not 0.0 < self.near_threshold < 1.0:
            raise ConfigError(f"ingest.near_threshold must be in (0, 1), got {self.near_threshold}")
        if self.pack_length < 0:
            raise ConfigError(f"ingest.pack_length must be >= 0, got {self.pack_length}")
        if self.pack_length and not self.tokenizer:
            raise ConfigError("ingest.pack_length needs ingest.tokenizer (try tokenizer: bytes)")
        if self.max_chars < self.min_chars:
            raise ConfigError(f"ingest.max_chars ({self.max_chars}) is below ingest.min_chars ({self.min_chars})")
        if self.pack_length and self.fields.strip() not in ("*", ""):
            raise ConfigError(
                "ingest.fields: packed rows (ingest.pack_length) hold several documents, so they keep no source "
                'fields; set ingest.fields to "*" or "", or pack_length to 0'
            )
        if self.fields.strip() not in ("*", "") and self.drop_fields.strip():
            raise ConfigError("ingest.fields and ingest.drop_fields: give one of them (fields names what to keep)")
        size = parse_size(self.shard_size, "ingest.shard_size")
        self.split_bytes()  # a split_size that does not parse is an error here, naming the key
        if self.pack_length and size >= 2**31:
            # A packed shard is one Parquet data page, whose size is a 32-bit field.
            raise ConfigError(f"ingest.shard_size {self.shard_size} is too large for packed tokens; use < 2GiB")

    def split_bytes(self) -> int:
        """`split_size` in bytes; 0: files are never split."""
        return 0 if str(self.split_size).strip() == "0" else parse_size(self.split_size, "ingest.split_size")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Which dataset a job trains on."""

    dataset: str = ".petatrain/datasets/demo"
    seed: int = 0
    # The held-out evaluation rows. "rows": every round(1/eval_fraction)-th row of each shard, from a row
    # a hash of the shard's number picks: an append adds held-out rows of its own and never moves one into
    # training (data/loading/heldout.py). "shards": the dataset's last eval_shards shards (when it has
    # more), as runs held out before; an append moves them, so a run on it cannot be continued onto one.
    eval_split: Literal["rows", "shards"] = "rows"
    eval_fraction: float = 0.01
    eval_shards: int = 1
    # `train --continue` onto a later version: the share of the carry-over pass drawn from the rows
    # the run trained on before (the new rows are read once each, with this share of old ones mixed in).
    replay: float = 0.05
    # The node-local shard cache of a remote dataset; "" is the node's own (PETATRAIN_CACHE_DIR, else
    # ~/.cache/petatrain), shared by every job and trial on the node, so a shard crosses the network once.
    cache_dir: str = ""

    def __post_init__(self) -> None:
        if self.eval_shards < 0:
            raise ConfigError(f"data.eval_shards must be >= 0, got {self.eval_shards}")
        if self.eval_split not in ("rows", "shards"):
            raise ConfigError(f"data.eval_split must be rows or shards, got {self.eval_split!r}")
        if not 0.0 <= self.eval_fraction <= 0.5:
            raise ConfigError(f"data.eval_fraction must be in [0, 0.5] (0.01: a row in 100), got {self.eval_fraction}")
        if not 0.0 <= self.replay < 1.0:
            raise ConfigError(f"data.replay must be in [0, 1) (0.05: 5% of the carry-over pass), got {self.replay}")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The network: a built-in GPT or MLP, or a user factory `package.module:function`."""

    kind: str = "gpt"  # "gpt" | "mlp" | "package.module:factory"
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    d_ff: int = 0  # 0 means 4 * d_model
    vocab_size: int = 256
    seq_len: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("gpt", "mlp") and ":" not in self.kind:
            raise ConfigError(f"model.kind: {self.kind!r} is not gpt, mlp or package.module:factory")
        for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.kind == "gpt" and self.d_model % self.n_head:
            raise ConfigError(f"model.d_model ({self.d_model}) must be a multiple of model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @property
    def ff_dim(self) -> int:
        return self.d_ff or 4 * self.d_model


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The optimisation: batch, schedule, precision, determinism."""

    steps: int = 100
    global_batch: int = 32  # sequences per optimizer step, whatever the worker count
    micro_batch: int = 8  # sequences per forward/backward on one worker
    lr: float = 3e-4
    # Cosine decays to this: an absolute rate (3e-5), or a share of train.lr ("10%"), which follows
    # train.lr wherever it is set (a search over train.lr never goes below it), as torchtitan's ratio does.
    min_lr: float | str = 3e-5
    warmup_steps: int = 10
    # The step the learning-rate schedule starts at: warm-up from it, cosine decay from its end to
    # train.steps. `train --continue` sets it to the step it continues from (the schedule re-warms).
    schedule_start: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    optimizer: Literal["adamw", "sgd"] = "adamw"
    precision: Literal["fp32", "bf16-mixed"] = "fp32"
    deterministic: bool = True
    # CPU: denormal floats read as zero. Arithmetic on them is microcode-slow on x86, and a
    # GPT's weights and optimizer state drift into them: a 1-rank CPU run at 3.2 steps/s ran
    # at 5.1 with it (README, Overhead). No effect on GPU kernels.
    flush_denormal: bool = True
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    attention: Literal["sdpa", "math"] = "sdpa"
    # torch.compile the model's forward where the worker builds it (nn.Module.compile, in place: the
    # parameter names, so checkpoints and served weights, stay the same). The first steps pay for the
    # compilation; a pipeline's stages call the model's parts directly and run uncompiled.
    compile: bool = False
    tokens: int = 0  # token budget for planning; 0 means steps * global_batch * seq_len
    eval_every: int = 0  # steps between evaluations on the held-out split; 0 = only at the end
    eval_batches: int = 4
    seed: int = 0

    @property
    def final_lr(self) -> float:
        """train.min_lr as a rate: itself, or its share of train.lr."""
        if isinstance(self.min_lr, str):
            return self.lr * float(self.min_lr.strip().removesuffix("%")) / 100
        return float(self.min_lr)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "eval_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch % self.micro_batch:
            raise ConfigError(
                f"train.global_batch ({self.global_batch}) must be a multiple of train.micro_batch ({self.micro_batch})"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"train.lr must be a finite number > 0 (e.g. 3e-4), got {self.lr}")
        if isinstance(self.min_lr, str) and not self.min_lr.strip().endswith("%"):
            # a number YAML read as text (3e-5 has no dot, so YAML 1.1 makes it a string)
            with contextlib.suppress(ValueError):
                self.min_lr = float(self.min_lr)
        if isinstance(self.min_lr, str):
            share = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*%\s*", self.min_lr)
            if share is None or float(share[1]) > 100:
                raise ConfigError(
                    f"train.min_lr must be a rate (3e-5) or a share of train.lr, 0% to 100% (10%), got {self.min_lr!r}"
                )
        elif isinstance(self.min_lr, bool) or not isinstance(self.min_lr, int | float):
            raise ConfigError(f"train.min_lr: expected a number or a share of train.lr (10%), got {self.min_lr!r}")
        elif not 0 <= self.min_lr <= self.lr:
            raise ConfigError(
                f"train.min_lr must be in [0, train.lr={self.lr}], got {self.min_lr} (or a share of it: 10%)"
            )
        for name in ("weight_decay", "grad_clip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"train.{name} must be a finite number >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.tokens < 0:
            raise ConfigError("train.warmup_steps, train.eval_every and train.tokens must be >= 0")
        if not 0 <= self.schedule_start < self.steps:
            raise ConfigError(
                f"train.schedule_start must be in [0, train.steps={self.steps}), got {self.schedule_start}"
            )


Strategy = Literal["ddp", "zero1", "zero2", "fsdp", "pipeline"]
Schedule = Literal["gpipe", "1f1b", "interleaved", "zbv"]


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """`parallel.strategy: pipeline`: the model in `stages` stages; workers = stages x data-parallel replicas.

    `microbatches` 0 picks 2 x stages (x chunks for interleaved and zbv); `chunks` is the model
    chunks each rank runs (2 for zbv, >= 2 for interleaved, 1 otherwise; 0 picks that);
    `partition` says where the stage boundaries go (`auto`: `profile` when a per-block profile
    of this model exists, else `parameters`); `data` is what a stage's replicas run."""

    stages: int = 2
    schedule: Schedule = "1f1b"
    microbatches: int = 0
    chunks: int = 0
    partition: Literal["auto", "uniform", "parameters", "profile"] = "auto"
    data: Literal["ddp", "fsdp"] = "ddp"

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"parallel.pipeline.stages must be >= 1, got {self.stages}")
        if self.microbatches < 0 or self.chunks < 0:
            raise ConfigError("parallel.pipeline.microbatches and parallel.pipeline.chunks must be >= 0 (0: chosen)")
        chunks = self.chunks_per_rank()
        if self.schedule == "zbv" and chunks != 2:
            raise ConfigError(f"parallel.pipeline.chunks: zbv runs 2 chunks per rank, not {chunks} (set 2 or 0)")
        if self.schedule == "interleaved" and chunks < 2:
            raise ConfigError(f"parallel.pipeline.chunks: interleaved needs >= 2 chunks per rank, not {chunks}")
        if self.schedule in ("gpipe", "1f1b") and chunks != 1:
            raise ConfigError(f"parallel.pipeline.chunks: {self.schedule} runs 1 chunk per rank, not {chunks}")
        m = self.microbatch_count()
        if self.schedule != "gpipe" and m < self.stages:
            raise ConfigError(
                f"parallel.pipeline.microbatches {m} < {self.stages} stages: {self.schedule} needs at least one "
                f"micro-batch per stage (set >= {self.stages}, e.g. {2 * self.stages})"
            )

    def chunks_per_rank(self) -> int:
        return self.chunks or (2 if self.schedule in ("interleaved", "zbv") else 1)

    def microbatch_count(self) -> int:
        return self.microbatches or 2 * self.stages


MAX_WORKERS = 100_000  # ranks: the largest training clusters hold about this many accelerators


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model is spread over workers. `workers` is a count or an elastic `min-max` range."""

    strategy: Strategy = "ddp"
    workers: str = "2"
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # Tensor-parallel degree: each layer split over this many ranks (a group inside a node); the
    # workers / tensor groups are data-parallel replicas under `strategy` (ddp or fsdp).
    tensor: int = 1

    def __post_init__(self) -> None:
        lo, hi = self.worker_range()
        if self.tensor < 1:
            raise ConfigError(f"parallel.tensor: need >= 1, got {self.tensor}")
        if lo % self.tensor or hi % self.tensor:
            raise ConfigError(
                f"parallel.workers {self.workers!r}: with parallel.tensor {self.tensor} every worker count must be "
                f"a multiple of {self.tensor} (tensor-parallel groups x data-parallel replicas)"
            )
        stages = self.pipeline.stages * self.tensor
        if self.strategy == "pipeline" and (lo % stages or hi % stages):
            shape = f"parallel.pipeline.stages {self.pipeline.stages}" + (
                f" x parallel.tensor {self.tensor}" if self.tensor > 1 else ""
            )
            raise ConfigError(
                f"parallel.workers {self.workers!r}: with {shape} every worker count must be "
                f"a multiple of {stages} (stages x data-parallel replicas), e.g. {stages} or {2 * stages}"
            )

    def data_parallel(self, workers: int) -> int:
        """Replicas the global batch is split over when `workers` ranks train."""
        groups = workers // self.tensor
        return groups // self.pipeline.stages if self.strategy == "pipeline" else groups

    def runs_on(self, workers: int, global_batch: int) -> bool:
        """Whether `workers` ranks can train a global batch of `global_batch` (an elastic run's choice)."""
        if self.strategy == "pipeline":
            replicas = self.data_parallel(workers)
            return (
                workers % (self.pipeline.stages * self.tensor) == 0
                and global_batch % (replicas * self.pipeline.microbatch_count()) == 0
            )
        return workers % self.tensor == 0 and global_batch % self.data_parallel(workers) == 0

    def worker_range(self) -> tuple[int, int]:
        text = str(self.workers).strip()
        low, _, high = text.partition("-")
        try:
            lo, hi = int(low), int(high or low)
        except ValueError:
            raise ConfigError(f"parallel.workers: {self.workers!r} is not a number or a range like 2-4") from None
        if not 1 <= lo <= hi:
            raise ConfigError(f"parallel.workers: need 1 <= min <= max, got {self.workers!r}")
        if hi > MAX_WORKERS:
            raise ConfigError(f"parallel.workers: {hi} is over {MAX_WORKERS:,} ranks, more than any cluster holds")
        return lo, hi


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """When checkpoints are taken and which are kept."""

    every: str = "20"  # steps ("20"), seconds ("30s") or "auto" (Young/Daly from stall and faults.mtbf_hours)
    keep_last: int = 3
    keep_every: int = 0  # also keep checkpoints whose step is a multiple of this; 0 = none
    # False: the loop waits for each checkpoint to be committed (the stall is the whole write),
    # as Ray Train's synchronous report(checkpoint=...) does; for debugging or a host without
    # memory for a second copy of the training state.
    asynchronous: bool = True
    # How a snapshot holds the training state on CPU: "copy" to host buffers; "live" writes the
    # weights themselves while the next step's forward and backward run (optimizer.step waits
    # for the write to have read them); "auto": for the built-in models, whichever of the two
    # measured cheaper (train/loop.py StagingChoice). On GPU, "auto" and "live" copy on the device
    # where it has room for a second copy of the state beside the training's peak, and the writer
    # moves that copy to pinned host memory while training goes on; else, and with "copy", the
    # loop waits for the copy to pinned host memory.
    staging: Literal["auto", "copy", "live"] = "auto"

    def __post_init__(self) -> None:
        self.interval()
        if self.keep_last < 1 or self.keep_every < 0:
            raise ConfigError("checkpoint.keep_last must be >= 1 and checkpoint.keep_every >= 0")

    def interval(self) -> tuple[str, float]:
        """("steps", n), ("seconds", s) or ("auto", 0)."""
        text = str(self.every).strip().lower()
        try:
            if text == "auto":
                return "auto", 0.0
            if text.endswith("s"):
                value, unit = float(text[:-1]), "seconds"
            else:
                value, unit = float(int(text)), "steps"
        except ValueError:
            raise ConfigError(
                f"checkpoint.every: {self.every!r} is not a step count, seconds like 30s, or auto"
            ) from None
        if value <= 0:
            raise ConfigError(f"checkpoint.every must be positive, got {self.every!r}")
        return unit, value


@dataclass(kw_only=True, slots=True)
class FaultsConfig:
    """How failures are survived."""

    max_restarts: int = 3
    hang_timeout_s: float = 20.0  # no step progress for this long on any rank = hung
    nonfinite: Literal["skip", "rollback"] = "skip"  # what a NaN/inf loss does
    mtbf_hours: float = 24.0  # per node, between failures that roll back (not preemptions), for checkpoint.every=auto
    # Where Ray Train's controller is an actor (a Ray Client driver, PETATRAIN_CONTROLLER=actor;
    # by default it runs in the driver, with nothing to start), start the next attempt's
    # controller once an attempt trains, so a restart need not wait for one: kill -> next step
    # 7.8 -> 4.9 s on 2 cores; its start-up costs ~1.1-1.7 s of training per attempt there.
    standby: bool = True
    # Once an attempt trains, start and import the next attempt's worker processes (spares) at
    # idle priority, so a restart's ranks skip Python, Ray, torch and Ray Train start-up
    # (petatrain.runtime.startup.spares).
    spares: bool = True
    # Fork every rank's process from one process per node that imported torch, Ray Train and petatrain
    # once, instead of each importing them (~4 s of CPU a rank; a restart's ranks start in ~0.2 s). Not
    # through Ray Client; on a joined cluster, a node without the driver's Python and petatrain at the
    # driver's paths starts its ranks with `python`. petatrain.runtime.startup.forkserver.
    forkserver: bool = True
    # On a cluster petatrain joined (--address): how long an attempt waits for room for the smallest
    # worker count (a replaced pod, the autoscaler's new node) before the run fails. A local Ray never grows.
    capacity_wait_s: float = 600.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.capacity_wait_s) and self.capacity_wait_s >= 0):
            raise ConfigError(f"faults.capacity_wait_s must be a number of seconds >= 0, got {self.capacity_wait_s}")
        if self.max_restarts < 0 or self.hang_timeout_s <= 0 or self.mtbf_hours <= 0:
            raise ConfigError("faults.max_restarts must be >= 0, faults.hang_timeout_s and faults.mtbf_hours > 0")
        if not math.isfinite(self.hang_timeout_s):
            raise ConfigError(f"faults.hang_timeout_s must be a finite number of seconds, got {self.hang_timeout_s}")


@dataclass(kw_only=True, slots=True)
class RayTlsConfig:
    """Ray's TLS (`RAY_USE_TLS`): PEM files of the cluster's CA and of this node's certificate and key
    (`petatrain keys tls DIR` writes them). All three, or none (no TLS)."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        given = [name for name in ("ca", "cert", "key") if getattr(self, name)]
        if given and len(given) != 3:
            missing = ", ".join(f"resources.tls.{n}" for n in ("ca", "cert", "key") if n not in given)
            raise ConfigError(f"Ray's TLS needs a CA, a certificate and a key: set {missing} too")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)


@dataclass(kw_only=True, slots=True)
class ResourcesConfig:
    address: str = ""  # Ray address; "" starts a local Ray
    cpus_per_worker: float = 1.0
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    tls: RayTlsConfig = field(default_factory=RayTlsConfig)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cpus_per_worker) and self.cpus_per_worker >= 0):
            raise ConfigError(f"resources.cpus_per_worker must be a finite number >= 0, got {self.cpus_per_worker}")


@dataclass(kw_only=True, slots=True)
class ObserveConfig:
    metrics_port: int = 0  # 0 picks a free port (written to the ledger's run_start)
    # "" turns the Prometheus endpoint off; "pod-ip": the driver's pod IP (POD_IP, else what its host name
    # resolves to), read where the driver runs (a Kubernetes head pod: manifests write it).
    metrics_host: str = "127.0.0.1"
    # After a run ends, an endpoint that was scraped stays up until the next scrape has read the
    # final values (goodput above all), at most this long: Prometheus' scrape interval (15 s by
    # default) or more. One nobody scraped closes at once; 0 never waits.
    metrics_linger_s: float = 15.0
    # The driver's health endpoint (runtime/health.py: GET /livez, /readyz), what a Kubernetes
    # probe of the head pod asks; "" turns it off, port 0 picks a free one (in the ledger's run_start).
    health_host: str = "127.0.0.1"
    health_port: int = 0
    health_window_s: float = 300.0  # /livez fails once no step completed (nor attempt started) for this long
    # An MLflow tracking server (http://host:5000): every run is mirrored there once it ends (config as
    # params, loss/eval/goodput as metrics, the report as artifacts), every promotion as a registered
    # model version. "" turns it off. Needs the client: pip install 'petatrain[mlflow]' (mlflow-skinny).
    mlflow_uri: str = ""
    mlflow_experiment: str = "petatrain"
    # torch.profiler over `profile_steps` steps from step `profile_at` (0: off) on every rank: a Chrome
    # trace and a summary of where each step's time went, each mesh dimension's communication included
    # (the report's mesh table), in RUN/traces/attempt-K/ (train/trace.py).
    profile_at: int = 0
    profile_steps: int = 3

    def __post_init__(self) -> None:
        if self.profile_at < 0 or self.profile_steps < 1:
            raise ConfigError(
                f"observe.profile_at must be >= 0 (0: off) and observe.profile_steps >= 1, got "
                f"{self.profile_at} and {self.profile_steps}"
            )
        for key in ("metrics_port", "health_port"):
            if not 0 <= getattr(self, key) <= 65535:
                raise ConfigError(f"observe.{key} must be in [0, 65535] (0 picks a free one), got {getattr(self, key)}")
        if not (math.isfinite(self.metrics_linger_s) and self.metrics_linger_s >= 0):
            raise ConfigError(
                f"observe.metrics_linger_s must be 0 or more seconds (0: close at once), got {self.metrics_linger_s}"
            )
        if not (math.isfinite(self.health_window_s) and self.health_window_s > 0):
            raise ConfigError(
                f"observe.health_window_s must be a positive number of seconds, got {self.health_window_s}"
            )


# Read from a config, never written back: JobConfig.to_dict (a run's config.yaml and run_start
# event, `petatrain config`, the workers' payload) leaves them out, reprs and errors hide them.
SECRET_STORAGE_KEYS = ("s3_access_key_id", "s3_secret_access_key")


@dataclass(kw_only=True, slots=True)
class EncryptionConfig:
    """`storage.encryption.key: KEYREF` encrypts what this config writes (dataset shards with Parquet
    modular encryption, checkpoints and final weights with AES-256-GCM) and decrypts what it reads.
    KEYREF is `file:PATH` (a keyring from `petatrain keys create PATH`) or a Barbican key container
    (`barbican+https://HOST:PORT/v1/containers/ID`); it names where the keys are, it is not a key
    (so it may be written in a run's config.yaml)."""

    key: str = ""

    def __post_init__(self) -> None:
        if self.key:
            check_keyref(self.key, "storage.encryption.key")


@dataclass(kw_only=True, slots=True)
class SigningConfig:
    """Signatures on the records that commit data: a dataset's manifest, a checkpoint's state, the
    final weights' record. Writers sign when a key with a signing half is configured (`key`, else
    `storage.encryption.key`). Readers holding a key verify every record and refuse one that is
    unsigned or signed by another key; `verify: true` also refuses to read without a key.
    `unsigned` lists datasets nobody signed (a public corpus) that may be read without a signature
    though a key is held; a signature such a dataset does carry is still verified."""

    key: str = ""  # KEYREF; a public-only keyring (`petatrain keys public`) verifies but cannot sign
    verify: bool = False
    unsigned: list[str] = field(default_factory=list)  # dataset URLs

    def __post_init__(self) -> None:
        if self.key:
            check_keyref(self.key, "storage.signing.key")
        if self.verify and self.unsigned:
            raise ConfigError(
                "storage.signing.verify: true refuses every unsigned record, and storage.signing.unsigned lists "
                "datasets to read unsigned: keep one"
            )


@dataclass(kw_only=True, slots=True)
class StorageConfig:
    """How to reach object stores.

    Leave the credentials out: empty keys come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    (or AWS_PROFILE) and the rest of botocore's credential chain (instance or pod role, SSO),
    so no file holds them. Keys set here are used, but never written anywhere.

    `sse` asks the store to encrypt what petatrain writes (SSE-S3, SSE-KMS or SSE-C; an SSE-C
    key is named by reference, env:NAME or file:PATH, never written here). Encrypted data goes
    over TLS only: a plain http:// endpoint is refused unless `allow_http` is true. `ca_bundle`
    is the PEM file of the CAs trusted for the endpoint's certificate (default: the system's).
    """

    s3_endpoint_url: str = ""
    s3_region: str = ""
    s3_access_key_id: str = field(default="", repr=False)
    s3_secret_access_key: str = field(default="", repr=False)
    s3_anonymous: bool = False
    ca_bundle: str = ""
    sse: ServerSideEncryption = field(default_factory=ServerSideEncryption)
    allow_http: bool = False
    encryption: EncryptionConfig = field(default_factory=EncryptionConfig)
    signing: SigningConfig = field(default_factory=SigningConfig)

    def __post_init__(self) -> None:
        if self.encrypted and not self.allow_http and self.s3_endpoint_url.lower().startswith("http://"):
            why = f"storage.sse.mode is {self.sse.mode}" if self.sse.enabled else "storage.encryption.key is set"
            raise ConfigError(
                f"storage.s3_endpoint_url {self.s3_endpoint_url} is plain HTTP but {why}: encrypted data goes "
                "over TLS only; use https://, or set storage.allow_http: true"
            )

    @property
    def encrypted(self) -> bool:
        """The data is meant to be encrypted: S3 must then be reached over TLS (unless allow_http)."""
        return self.sse.enabled or bool(self.encryption.key)

    def options(self) -> StorageOptions:
        values = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("encryption", "signing")
        }
        protection = Protection(
            encryption_key=self.encryption.key,
            signing_key=self.signing.key or self.encryption.key,
            verify_signatures=self.signing.verify,
            unsigned_datasets=tuple(self.signing.unsigned),
        )
        return StorageOptions(**values, encrypted=self.encrypted, protection=protection)


@dataclass(kw_only=True, slots=True)
class PromoteConfig:
    """The evaluation gate of `petatrain evaluate` and `promote` (registry/gate.py), and the registry."""

    # The candidate's loss on the held-out rows of the newest data must be lower than the incumbent's
    # by this share (0.0: not worse), and on the earlier data higher by at most max_regression.
    min_improvement: float = 0.0
    max_regression: float = 0.01
    max_rows: int = 2048  # held-out rows evaluated per split (the same for both models)
    # A split with fewer held-out rows than this is noise, not evidence: it is judged on all of them.
    min_rows: int = 64
    registry: str = ""  # the registry's URL; "" is $PETATRAIN_REGISTRY, else .petatrain/registry

    def __post_init__(self) -> None:
        for key in ("min_improvement", "max_regression"):
            value = getattr(self, key)
            if not (math.isfinite(value) and -1.0 < value < 1.0):
                raise ConfigError(f"promote.{key} must be a share in (-1, 1) (0.01: 1%), got {value}")
        if self.max_rows < 1:
            raise ConfigError(f"promote.max_rows must be >= 1, got {self.max_rows}")
        if not 0 <= self.min_rows <= self.max_rows:
            raise ConfigError(f"promote.min_rows must be in [0, promote.max_rows], got {self.min_rows}")


@dataclass(kw_only=True, slots=True)
class ServeConfig:
    """How `petatrain serve` runs the model a run trained (the run's config.yaml holds it; the
    command's flags override it)."""

    replicas: str = "1"  # N, or MIN-MAX: Serve autoscales between them on ongoing requests
    max_batch: int = 16  # requests a replica completes together
    batch_wait_s: float = 0.01  # the longest a request waits for others to batch with
    target_ongoing_requests: int = 0  # per replica, when autoscaling (0: max_batch)
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    cpus_per_replica: float = 1.0
    follow_poll_s: float = 5.0  # --follow: how often a replica looks for a newer checkpoint
    max_request_bytes: int = 4 * 2**20  # a larger request body is refused (HTTP 413)
    request_timeout_s: float = 10.0  # a body that takes longer to arrive is refused (HTTP 408)

    def __post_init__(self) -> None:
        self.replica_range()
        if self.max_request_bytes < 1024 or not (math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0):
            raise ConfigError(
                "serve.max_request_bytes must be >= 1024 and serve.request_timeout_s a positive number of seconds"
            )
        if self.max_batch < 1 or self.target_ongoing_requests < 0:
            raise ConfigError("serve.max_batch must be >= 1 and serve.target_ongoing_requests >= 0")
        for key in ("batch_wait_s", "upscale_delay_s", "downscale_delay_s", "cpus_per_replica"):
            if getattr(self, key) < 0:
                raise ConfigError(f"serve.{key} must be >= 0, got {getattr(self, key)}")
        if self.follow_poll_s <= 0:
            raise ConfigError(f"serve.follow_poll_s must be > 0, got {self.follow_poll_s}")

    def deployment_options(self) -> dict[str, Any]:
        """Ray Serve's deployment options (for `serve.deployment(...).options` and a RayService's
        serveConfigV2): replicas, fixed or Serve's autoscaling between min and max on ongoing
        requests; CPUs; as many requests in flight per replica as two batches."""
        low, high = self.replica_range()
        scale: dict[str, Any] = {"num_replicas": low}
        if high > low:
            scale = {
                "autoscaling_config": {
                    "min_replicas": low, "max_replicas": high,
                    "target_ongoing_requests": self.target_ongoing_requests or self.max_batch,
                    "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s,
                }
            }  # fmt: skip
        return {
            **scale,
            "ray_actor_options": {"num_cpus": self.cpus_per_replica},
            "max_ongoing_requests": 2 * self.max_batch,
            # A stopping replica checks for requests still in flight this often (Serve's default, 2 s,
            # is also its first wait: every stop, scale-down and redeploy took 2 s more than its drain).
            "graceful_shutdown_wait_loop_s": 0.25,
        }

    def replica_range(self) -> tuple[int, int]:
        """(min, max) replicas: `N` or `MIN-MAX`."""
        low, _, high = str(self.replicas).partition("-")
        try:
            bounds = int(low), int(high or low)
        except ValueError:
            raise ConfigError(f"serve.replicas {self.replicas!r}: a count (2) or a range (1-4)") from None
        if bounds[0] < 0 or bounds[1] < max(1, bounds[0]):
            raise ConfigError(f"serve.replicas {self.replicas!r}: MIN >= 0 and MAX >= max(MIN, 1), e.g. 1-4")
        return bounds


@dataclass(kw_only=True, slots=True)
class PlanConfig:
    """What `petatrain plan` assumes about prices, storage and restarts (the catalog has the hardware)."""

    prices: dict[str, float] = field(default_factory=dict)  # accelerator -> USD per device-hour, on-demand
    spot_prices: dict[str, float] = field(default_factory=dict)  # accelerator -> USD per device-hour, spot
    spot_fraction: float = 0.4  # spot price as a fraction of on-demand where spot_prices has none
    spot_mtbf_hours: float = 12.0  # mean time between preemptions per node on spot
    storage_bandwidth: str = "2GB/s"  # read bandwidth per node from the dataset's storage
    checkpoint_bandwidth: str = "1GB/s"  # write bandwidth per node to the checkpoint storage
    restart_s: float = 300.0  # time from a failure to training again (detect, reschedule, load)
    calibration_dir: str = ""  # where `profile` writes calibrations; "" = ~/.cache/petatrain/calibration
    # `profile` saves no calibration whose timed steps spread more than this (interquartile range
    # over the median): their machine was busy, and the plan would learn its noise.
    calibration_max_spread: float = 0.15

    def __post_init__(self) -> None:
        for key in ("prices", "spot_prices"):
            table = getattr(self, key)
            if not isinstance(table, dict):
                raise ConfigError(f"plan.{key}: expected a mapping of accelerator name to USD per hour")
            for name, value in table.items():
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ConfigError(f"plan.{key}.{name}: expected a price in USD per hour >= 0, got {value!r}")
        if not 0.0 < self.spot_fraction <= 1.0:
            raise ConfigError(f"plan.spot_fraction must be in (0, 1], got {self.spot_fraction}")
        if self.spot_mtbf_hours <= 0 or self.restart_s < 0:
            raise ConfigError("plan.spot_mtbf_hours must be > 0 and plan.restart_s >= 0")
        if not (math.isfinite(self.calibration_max_spread) and self.calibration_max_spread >= 0):
            raise ConfigError(
                f"plan.calibration_max_spread must be a share >= 0 (0.15: 15%), got {self.calibration_max_spread}"
            )
        parse_size(self.storage_bandwidth.removesuffix("/s"), "plan.storage_bandwidth")
        parse_size(self.checkpoint_bandwidth.removesuffix("/s"), "plan.checkpoint_bandwidth")


TUNE_SCHEDULERS = ("asha", "pbt", "none")
TUNE_SEARCHES = ("random", "optuna")
TUNE_METRICS = ("eval_loss", "train_loss")  # what each trial reports at every evaluation


MAX_TRIALS = 10_000


@dataclass(kw_only=True, slots=True)
class TuneConfig:
    """`petatrain tune`: a hyperparameter search on Ray Tune, each trial a training run of this
    config with `params` sampled (its command-line flags override these)."""

    # Config field -> space: "loguniform:1e-4:1e-2", "uniform:0:0.1", "choice:64,128,256", "randint:1:8".
    params: dict[str, str] = field(default_factory=dict)
    trials: int = 4
    scheduler: str = "asha"  # asha | pbt | none
    search: str = "random"  # random | optuna (Tune's OptunaSearch; not with pbt)
    metric: str = "eval_loss"
    mode: str = "min"  # min | max
    max_steps: int = 0  # steps per trial; 0: train.steps
    concurrent: int = 0  # trials at once; 0: as many as the cluster's CPUs/GPUs hold whole
    grace_evals: int = 1  # asha: evaluations a trial runs before it may be stopped
    reduction_factor: int = 2  # asha: 1/reduction_factor of the trials go on at each rung; pbt: quantile
    perturbation_evals: int = 1  # pbt: evaluations between exploits
    pbt_synch: bool = False  # pbt: trials wait for each other at every perturbation (reproducible decisions)
    max_failures: int = 2  # times Tune restarts a trial whose driver died (it resumes from its checkpoint)
    seed: int = 0  # of the sampling (and of pbt's choices)

    def __post_init__(self) -> None:
        if not isinstance(self.params, dict) or not all(isinstance(k, str) for k in self.params):
            raise ConfigError("tune.params: expected a mapping of field -> space (train.lr: loguniform:1e-4:1e-2)")
        self.params = {k: str(v) for k, v in self.params.items()}
        for key, allowed in (("scheduler", TUNE_SCHEDULERS), ("search", TUNE_SEARCHES), ("mode", ("min", "max"))):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"tune.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.metric not in TUNE_METRICS:
            raise ConfigError(
                f"tune.metric: {self.metric!r} is never reported; a trial reports {', '.join(TUNE_METRICS)} "
                "at each evaluation"
            )
        for key in ("trials", "grace_evals", "perturbation_evals"):
            if getattr(self, key) < 1:
                raise ConfigError(f"tune.{key} must be >= 1, got {getattr(self, key)}")
        if self.trials > MAX_TRIALS:  # each is a run folder, an actor and rows in Tune's state
            raise ConfigError(f"tune.trials {self.trials} is over {MAX_TRIALS}; search in several rounds")
        if self.reduction_factor < 2:
            raise ConfigError(f"tune.reduction_factor must be >= 2, got {self.reduction_factor}")
        for key in ("max_steps", "concurrent", "max_failures"):
            if getattr(self, key) < 0:
                raise ConfigError(f"tune.{key} must be >= 0, got {getattr(self, key)}")
        if self.scheduler == "pbt" and self.search == "optuna":
            raise ConfigError("tune.search: optuna chooses each trial's parameters once; pbt mutates them (use random)")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    data: DataConfig = field(default_factory=DataConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    promote: PromoteConfig = field(default_factory=PromoteConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, less the storage credentials that are set."""
        values = dataclasses.asdict(self)
        for key in SECRET_STORAGE_KEYS:
            if values["storage"][key]:
                del values["storage"][key]
        return values

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# What a driver continuing a run (`train --resume`) may change: how far it trains, how it is
# spread (checkpoints are saved per named parameter and the loader's position is global, so a
# run resumes on another strategy, world size or pipeline shape with the same next steps; the
# micro-batch and recompute change the accumulation, not the step), and how it is watched and
# stored. Anything else (data, model, the optimisation) would make a different run, so it is
# refused with the difference named.
RESUMABLE = (
    "train.steps", "train.micro_batch", "train.activation_checkpointing", "train.compile", "parallel", "checkpoint",
    "faults", "resources", "observe", "storage", "plan", "serve", "ingest", "tune", "promote", "data.cache_dir",
)  # fmt: skip


def resume_differences(before: dict[str, Any], after: JobConfig, may_change: Sequence[str] = ()) -> list[str]:
    """The fields where `after` differs from a run's config (`before`, as `to_dict` wrote it) that a
    continuing run may not change: "train.lr: 0.001 in the run, 0.002 here". Fields the run's
    config predates are not compared; `may_change` adds to `RESUMABLE` (dotted fields or sections)."""
    old, new = _flat(before), _flat(json.loads(json.dumps(after.to_dict(), default=str)))  # as the ledger has it
    free = (*RESUMABLE, *may_change)
    changed = []
    for key, value in new.items():
        if key in old and old[key] != value and not any(key == r or key.startswith(r + ".") for r in free):
            changed.append(f"{key}: {old[key]!r} in the run, {value!r} here")
    return changed


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
