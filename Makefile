# Two commands on a fresh machine: `make demo` and `make test`.
# torch==2.13.0 is installed first: a looser torch spec would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.fxgrad-installed

.PHONY: setup demo examples lint test test-fast fuzz bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: setup
	$(PY) examples/quickstart.py

examples: setup
	$(PY) -m pip install --quiet -e ".[examples]"
	for example in lstm_clipping resnet_rescale telemetry sinkgd hf_trainer policy_value rollback tensorboard_norms; do \
		$(PY) examples/$$example.py || exit 1; \
	done

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint  # two workers: most of a test's time is single-threaded compiling
	$(PY) -m pytest -q -n 2

test-fast: setup
	$(PY) -m pytest -q -m "not inductor and not slow"

fuzz: setup  # a longer random search of tests/test_fuzz.py; FXGRAD_FUZZ_EXAMPLES=N sets its length
	FXGRAD_FUZZ=deep $(PY) -m pytest -q tests/test_fuzz.py --hypothesis-show-statistics

bench: setup  # SGD, then fused AdamW with the fold, then DDP and FSDP2 on 2 processes
	$(PY) bench/run.py
	$(PY) bench/run.py --models deep_mlp,gpt2,resnet --policies global_clip --optimizer adamw-fused \
		--no-pass-scaling --compile-policies '' --out bench/results/fold.md
	for policy in global_clip full; do \
		$(PY) bench/ddp.py --policy $$policy --optimizer adamw-fused || exit 1; \
		$(PY) bench/ddp.py --fsdp2 --policy $$policy --steps 3 || exit 1; \
	done

clean:
	rm -rf $(VENV) build *.egg-info
