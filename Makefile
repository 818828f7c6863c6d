# Everything a fresh clone needs: `make demo` and `make test` create .venv and install.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench soak gpu-check gpu-wheels lint format s3-start s3-stop clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build, not several GB of CUDA wheels.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/petatrain demo

# The suite starts (and stops) a local Ceph RADOS Gateway for the s3-marked tests,
# installing it from Debian packages if needed. PETATRAIN_TEST_S3_ENDPOINT=http://host:port
# (with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) runs the same tests against any S3 store.
# tests/test_kms.py likewise starts (and stops) OpenStack Barbican (tests/kms/barbican.sh).
test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not s3"

# MosaicML Streaming is a loader-benchmark peer only; its pins (numpy<2.2, xxhash<4, a CUDA
# torch) conflict with ours, so it goes in without dependencies (see benchmarks/loader.py).
bench: $(STAMP)
	$(BIN)/python -c "import importlib.metadata as m; m.version('mosaicml-streaming')" 2>/dev/null || ( \
	  $(BIN)/python -m pip install -q --no-deps mosaicml-streaming==0.13.0 && \
	  $(BIN)/python -m pip install -q brotli==1.2.1 python-snappy==0.7.3 zstd==1.5.7.2 catalogue==2.0.10 \
	    transformers==5.23.0 )
	# accelerate and DeepSpeed are plan-accuracy peers only; --no-deps keeps the CPU torch pin.
	$(BIN)/python -c "import deepspeed, accelerate" 2>/dev/null || \
	  $(BIN)/python -m pip install -q --no-deps accelerate==1.15.0 deepspeed==0.19.8 psutil==7.2.2 hjson==3.1.0 \
	    py-cpuinfo==9.0.0 ninja==1.13.2 einops==0.8.2
	$(BIN)/python benchmarks/ingest.py
	$(BIN)/python benchmarks/lineage.py
	$(BIN)/python benchmarks/loader.py
	$(BIN)/python benchmarks/plan_accuracy.py
	$(BIN)/python benchmarks/checkpoint.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/tune.py

# 20 minutes: training with a random fault every 2 minutes, then its goodput.
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py

# The GPU check (benchmarks/gpu.py, <= 8 minutes on one H100), run on the GPU machine: no .venv, no Ray,
# no internet there; the few wheels it lacks travel in .whl/ (`make gpu-wheels`, run here).
GPU_PYTHON ?= python3
GPU_OUT    ?= benchmarks/results
gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile \
	  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; fi
	PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu.py --out $(GPU_OUT)

# The wheels of benchmarks/gpu-wheels.txt for the GPU machine's Python 3.12, into .whl/ (git-ignored). They
# travel with the working tree, which may carry 64 MiB in all: refused above 32 MiB, with the tree.
GPU_WHEELS_MAX_MIB := 32
gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl -r benchmarks/gpu-wheels.txt
	@ls -l .whl; wheels=$$(du -cb .whl/*.whl | tail -1 | cut -f1); \
	  tree=$$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1); \
	  echo "gpu-wheels: $$((wheels / 1024)) KiB of wheels + $$((tree / 1024)) KiB of tracked files" \
	    "= $$(((wheels + tree) / 1048576)) MiB to carry (limit 64 MiB)"; \
	  if [ $$((wheels + tree)) -gt $$(($(GPU_WHEELS_MAX_MIB) * 1048576)) ]; then \
	    echo "gpu-wheels: over $(GPU_WHEELS_MAX_MIB) MiB: not well under the 64 MiB a device run carries" >&2; exit 1; fi

# The docs too: their generated reference must match the code, and the site must build with --strict
# (a broken link or anchor, or a page missing from the nav, fails); the build goes to a temporary folder.
# (No -q: mkdocs -q hides the warnings, and --strict then passes.)
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/ruff format --check src tests benchmarks docs
	$(BIN)/mypy
	$(BIN)/python docs/gen_reference.py --check
	d=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d "$$d"; s=$$?; rm -rf "$$d"; exit $$s

# The documentation site: docs/reference/ regenerated from the code, then docs/ built into site/
# (`$(BIN)/mkdocs serve` to browse it while editing).
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python docs/gen_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks docs
	$(BIN)/ruff check --fix src tests benchmarks docs

s3-start:
	bash tests/s3server/rgw.sh start

s3-stop:
	bash tests/s3server/rgw.sh stop

clean:
	rm -rf $(VENV) .petatrain .pytest_cache .ruff_cache site
