"""What the benchmark scripts share: where they work, how they record results, the corpus.

benchmarks/ is not a package: each script runs as `python benchmarks/NAME.py`, which puts
this folder first on sys.path, so `from _common import ...` finds this file.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / ".work"
RESULTS = HERE / "results"


def write_results(name: str, fields: dict, *, machine_extra: dict | None = None) -> Path:
    """benchmarks/results/NAME.json: the benchmark's name, the UTC date, the machine, then `fields`."""
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    record = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine() | (machine_extra or {}),
    }
    out.write_text(json.dumps(record | fields, indent=2, default=float) + "\n")
    print(f"wrote {out}")
    return out


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as handle:
        cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import ray
    import torch

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "pyarrow": pa.__version__,
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def version(dist: str) -> str | None:
    """The installed version of distribution `dist`, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_by_pid() -> dict[int, float]:
    """CPU seconds of every process, with the children it reaped (but not init's: it reaps our orphans)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as handle:
                ticks = [int(v) for v in handle.read().rsplit(")", 1)[1].split()[11:15]]
                out[int(entry)] = sum(ticks[:2] if entry == "1" else ticks) / os.sysconf("SC_CLK_TCK")
    return out


def corpus(mb: int) -> tuple[list[str], int]:
    """A synthetic JSONL corpus of about `mb` MB in benchmarks/.work, made once; (files, bytes)."""
    from petatrain.data import synth

    folder = WORK / f"corpus-{mb}mb"
    marker = folder / "DONE"
    if not marker.exists():
        shutil.rmtree(folder, ignore_errors=True)
        docs = int(mb * 1e6 / 1200)  # ~1.1 KB per document with 150 words on average
        print(f"generating ~{mb} MB corpus in {folder} ...", file=sys.stderr)
        synth.generate(str(folder), documents=docs, files=max(4, mb // 10), mean_words=150, seed=1)
        marker.write_text("")
    files = sorted(str(p) for p in folder.glob("*.jsonl"))
    return files, sum(os.path.getsize(f) for f in files)
