# Everything a fresh clone needs: `make demo` and `make test` create .venv and install.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast bench soak lint format s3-start s3-stop clean

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

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

s3-start:
	bash tests/s3server/rgw.sh start

s3-stop:
	bash tests/s3server/rgw.sh stop

clean:
	rm -rf $(VENV) .petatrain .pytest_cache .ruff_cache
