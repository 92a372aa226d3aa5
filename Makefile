# lmfoundry developer entry points. `make demo` and `make test` work on a fresh machine
# (CPU only, no internet but the package registries).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# 2-core machines slow down badly when thread pools oversubscribe; tests use one thread.
OMP ?= 2
DEMO_OUT ?= demo-out/smollm2-w4a16-g64
PPL_WINDOWS ?= 40

.PHONY: venv demo test test-integration test-slow lint clean

venv: $(VENV)/.installed

# torch first (2.13.0; on our CPU machines pip takes the local CPU wheel): a bare `torch`
# requirement resolved later would otherwise pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $@

demo: venv
	OMP_NUM_THREADS=$(OMP) $(BIN)/lmfoundry quantize smollm2-135m --recipe recipes/smollm2-w4a16-rtn.yaml \
		-o $(DEMO_OUT) --overwrite
	$(BIN)/lmfoundry inspect $(DEMO_OUT)
	OMP_NUM_THREADS=$(OMP) $(BIN)/lmfoundry eval ppl smollm2-135m $(DEMO_OUT) --max-windows $(PPL_WINDOWS)

# PYTHONSAFEPATH=1: neither pytest nor any Python process a test starts gets the checkout root on
# sys.path, where its bare lmfoundry/ and kernels/ folders would shadow the installed packages.
test: venv
	OMP_NUM_THREADS=1 PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q

# Static checks; CI runs them before the tests. Settings are in pyproject.toml ([tool.ruff],
# [tool.mypy]). mypy needs the installed layout (lmfoundry.quantizers = quantizers/, ...): a tree
# of links under build/typecheck gives it that. Keep PACKAGE_DIRS in step with pyproject's
# [tool.setuptools.package-dir].
PACKAGE_DIRS := quantizers calibration compile kernels runtime evals recipes
TYPECHECK := build/typecheck
lint: venv
	$(BIN)/ruff check .
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/lmfoundry
	ln -s $(CURDIR)/lmfoundry/* $(TYPECHECK)/lmfoundry/
	for d in $(PACKAGE_DIRS); do ln -s $(CURDIR)/$$d $(TYPECHECK)/lmfoundry/$$d; done
	$(BIN)/mypy $(TYPECHECK)/lmfoundry

# real-model tests that take minutes in total (CI runs this tier after `make test`)
test-integration: venv
	OMP_NUM_THREADS=$(OMP) PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -m "slow and not heavy"

# every slow test, including the real-model eval-gate runs (about an hour on 2 cores)
test-slow: venv
	OMP_NUM_THREADS=$(OMP) PYTHONSAFEPATH=1 $(BIN)/python -m pytest -q -m slow

clean:
	rm -rf demo-out build *.egg-info
