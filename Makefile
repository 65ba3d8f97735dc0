# Two commands for a fresh clone on a CPU machine (each sets up .venv itself):
#   make demo   dispersion profile of SmolLM2-135M over Python's own documentation
#   make test   the test suite, offline
VENV ?= .venv
PYTEST_ARGS ?=
export HF_HUB_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS = 1

.PHONY: test test-min check-install demo venv bench clean reproduce-smoke any-model

venv:
	bash scripts/bootstrap.sh dev

test: venv
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

test-min:  # the lowest versions pyproject declares, core and extras together (constraints/floors.txt), in .venv-min
	test -x .venv-min/bin/python || python3 -m venv .venv-min
	.venv-min/bin/python -m pip install --quiet --disable-pip-version-check -c constraints/floors.txt torch==2.13.0 \
		-e ".[lmeval,mteb,train,peft,compare]" pytest pytest-xdist
	.venv-min/bin/python -m pytest -n 2 -p no:cacheprovider $(PYTEST_ARGS) tests/test_dispersion_math.py \
		tests/test_invariance.py tests/test_capture.py tests/test_addresses.py tests/test_model_loading.py \
		tests/test_discovery.py tests/test_lmeval_wrapper.py tests/test_lmeval_tasks.py tests/test_mteb_layers.py \
		tests/test_train_cmd.py tests/test_trainer.py tests/test_compare.py tests/test_missing_extras.py

check-install: venv  # the built wheel with each extra alone, in fresh venvs (scripts/check_install.py)
	$(VENV)/bin/python scripts/check_install.py $(if $(EXTRAS),--extras $(EXTRAS),)

reproduce-smoke: venv  # every gallery experiment at a tiny size (experiments/README.md)
	$(VENV)/bin/python -m pytest -n 2 --dist load -m "reproduce or not reproduce" tests/test_experiments.py $(PYTEST_ARGS)

any-model: venv  # every transformers model type at tiny size: built, loaded, measured equal, sub-layers verified
	$(VENV)/bin/python benchmarks/any_model.py --write

demo:
	bash scripts/bootstrap.sh demo
	$(VENV)/bin/repgeom demo

bench: venv
	$(VENV)/bin/python benchmarks/bench_dispersion.py
	$(VENV)/bin/python benchmarks/bench_capture.py
	$(VENV)/bin/python benchmarks/bench_gap.py
	$(VENV)/bin/python benchmarks/bench_metrics.py
	$(VENV)/bin/python benchmarks/bench_aux_losses.py
	$(VENV)/bin/python benchmarks/bench_geometry_callback.py
	$(VENV)/bin/python benchmarks/bench_lmeval.py
	$(VENV)/bin/python benchmarks/bench_mteb_sweep.py
	$(VENV)/bin/python benchmarks/bench_knnlm.py
	$(VENV)/bin/python benchmarks/bench_streaming.py
	$(VENV)/bin/python benchmarks/bench_startup.py
	$(VENV)/bin/python benchmarks/bench_startup_hook.py
	$(VENV)/bin/python benchmarks/bench_vs_script.py
	$(VENV)/bin/python benchmarks/bench_ppl_bins.py
	$(VENV)/bin/python benchmarks/bench_gap_series.py --n 3 --params small  # the full series: --n 10 (22 GB of disk)
	$(VENV)/bin/python benchmarks/bench_discovery.py

clean:
	rm -rf $(VENV) repgeom-demo .pytest_cache
