# One-command setup and test. A fresh machine needs only Python 3.10+.
#   make test    create .venv, install, run the per-commit CPU suite
#   make list    show what the per-commit suite runs
#   make serve   write a tiny checkpoint (ARCH=qwen3 by default) and serve it with HiCache + file storage
#                (L3=mooncake: over a local Mooncake master instead, stopped with the server)
#   make clean-serve   remove what make serve keeps between runs (checkpoint, L3 directory)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SUITE ?= per-commit-cpu
HW ?= cpu
TIMEOUT_PER_FILE ?= 1800
# extra run_suite.py / pytest arguments, e.g. ARGS="--hypothesis-seed 7 -k round_trip"
ARGS ?=

.PHONY: install test list bench serve clean clean-serve

$(VENV)/.installed: python/pyproject.toml python/setup.py scripts/ci/install_system_packages.sh python/sglang/srt/mem_cache/kvcacheio/csrc/native_copy.c python/sglang/srt/mem_cache/storage/csrc/native_files.c Makefile
	bash scripts/ci/install_system_packages.sh
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU build on local disk, not a multi-GB CUDA download
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e "python[test,nixl,serve,mooncake]"
	# nixl-cu12 provides the library; the "nixl" wheel provides `import nixl`
	$(PY) -m pip install -q --no-deps nixl==1.5.1
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) test/run_suite.py --hw $(HW) --suite $(SUITE) --timeout-per-file $(TIMEOUT_PER_FILE) $(ARGS)

list: install
	$(PY) test/run_suite.py --hw $(HW) --suite $(SUITE) --list

SERVE_DIR ?= .cache/serve
ARCH ?= qwen3
PORT ?= 30000
# L3=mooncake: a local mooncake_master on 127.0.0.1 (ports MOONCAKE_RPC_PORT, MOONCAKE_HTTP_PORT,
# MOONCAKE_METRICS_PORT: 50051, 8080, 9003), stopped with the server (scripts/serve_mooncake.sh)
L3 ?= file
MOONCAKE_RPC_PORT ?= 50051
MOONCAKE_HTTP_PORT ?= 8080
MOONCAKE_METRICS_PORT ?= 9003
serve: install
	$(PY) scripts/make_tiny_model.py --arch $(ARCH) --out $(SERVE_DIR)/tiny-$(ARCH)
ifeq ($(L3),mooncake)
	MOONCAKE_RPC_PORT=$(MOONCAKE_RPC_PORT) MOONCAKE_HTTP_PORT=$(MOONCAKE_HTTP_PORT) \
		MOONCAKE_METRICS_PORT=$(MOONCAKE_METRICS_PORT) MOONCAKE_LOG=$(SERVE_DIR)/mooncake_master.log \
		bash scripts/serve_mooncake.sh $(PY) $(SERVE_DIR)/tiny-$(ARCH) $(PORT)
else ifeq ($(L3),file)
	OMP_NUM_THREADS=1 $(PY) -m sglang.launch_server --model-path $(SERVE_DIR)/tiny-$(ARCH) --port $(PORT) \
		--max-total-tokens 8192 --page-size 16 --enable-hierarchical-cache --hicache-storage-backend file \
		--hicache-storage-backend-extra-config '{"storage_dir": "$(SERVE_DIR)/hicache-l3", "prefetch_threshold": 64}'
else
	$(error L3=$(L3): allowed values are file (the default) and mooncake)
endif

bench: install
	$(PY) scripts/bench/bench_kvcacheio.py

clean:
	rm -rf $(VENV)

# the served checkpoint and its L3 directory ($(SERVE_DIR)/hicache-l3 persists between serves)
clean-serve:
	rm -rf $(SERVE_DIR)
