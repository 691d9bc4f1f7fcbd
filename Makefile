# Everything a fresh machine needs: `make demo` trains the embedded default, `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast lint install bench docs dist core-check deploy-check constraints clean durations

# Every extra and the test tools, at the versions in constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/ddplab train --nproc-per-node 2

# The whole suite: one pytest-xdist worker per core and one more, as the multi-process tests spend part of their
# time waiting (start-up, rendezvous, timeouts); on 2 cores, with a smaller suite, this pass took 558 s with 3
# workers, 587 s with 4 and 623 s with 2; with today's 850 tests it took 540 s with 3 in a fresh clone (the
# serial pass after it 78 s), its jobs started warm: forked from one process per worker that has imported torch and
# transformers (tests/warm.py; DDPLAB_TESTS_WARM=0 starts each from a fresh interpreter, as the pass did in 1,300-1,450 s). A
# test file's tests share one worker, so a run trained once per file is trained once, and one that several files
# read is trained once per session (tests/references.py); the longest files start first (tests/durations.json);
# the pass ends with its 15 slowest tests (those over 10 s). Then the tests that check wall-clock time or race a
# loaded machine, alone.
# Tiers: tests/tiers.py.
PYTEST  := OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra
WORKERS ?= $(shell $(PYTHON) -c "import os; print(len(os.sched_getaffinity(0)) + 1)")
# The serial tests' files only: collecting them takes 3 s, collecting every file 7 s.
SERIAL  := $(shell grep -l "mark.serial" tests/test_*.py)
test: lint
	$(PYTEST) -n $(WORKERS) --dist loadscope --no-loadscope-reorder -m "not serial" --durations=15 --durations-min=10
	$(PYTEST) -m serial $(SERIAL) || [ $$? -eq 5 ]  # 5: no such test

# tests/durations.json (each file's seconds, which orders the parallel pass: the longest files start first) from a
# whole parallel pass; refresh it when files grow or shrink much. A stale one only orders the files less well.
durations: $(STAMP)
	$(PYTEST) -n $(WORKERS) --dist loadscope -m "not serial" --junitxml=.durations.xml || true
	$(PY) tests/tiers.py .durations.xml
	rm -f .durations.xml

# The unit and in-process tiers: no test starts a process.
test-fast: $(STAMP)
	$(PYTEST) -n auto --dist loadscope --no-loadscope-reorder -m "not multiproc"

# Lint, format and types, with zero findings (settings in pyproject.toml; mypy checks src/). `make test` runs it first.
LINTED := src tests benchmarks deploy
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	$(PY) benchmarks/overhead.py

# The config reference is regenerated from the config's own help, then the site is built into site/.
docs: $(STAMP)
	$(PY) docs/gen_config.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# A wheel and an sdist in dist/, checked as a package index would check them. No registry hosts ddplab: users
# install this wheel (docs/getting-started.md).
dist: $(STAMP)
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

# The wheel alone (no extras), in a fresh environment: it trains the embedded default and a workload of plain
# tensors (2 processes), and a workload that needs an extra says which in one line (exit 2). (tests/test_dist.py
# installs the same wheel beside the suite's torch instead, and trains there too.)
CORE := .venv-core
core-check: dist
	rm -rf $(CORE) && $(PYTHON) -m venv $(CORE)
	$(CORE)/bin/python -m pip install -q -c constraints.txt dist/ddplab-*.whl
	test "$$($(CORE)/bin/ddplab --version)" = "ddplab $$($(PY) -c 'import ddplab; print(ddplab.__version__)')"
	cd $$(mktemp -d) && OMP_NUM_THREADS=1 $(CURDIR)/$(CORE)/bin/ddplab train training.max_steps=5 generate.max_new_tokens=20 \
		&& OMP_NUM_THREADS=1 $(CURDIR)/$(CORE)/bin/ddplab train model.name=$(CURDIR)/examples/my_workload.py:model \
			data.name=$(CURDIR)/examples/my_workload.py:data training.epochs=2 training.warmup_steps=0 --nproc-per-node 2 \
		&& ! $(CURDIR)/$(CORE)/bin/ddplab train data.name=synthetic_reviews model.name=transformer 2> err.txt \
		&& grep -q "needs transformers.*: pip install 'transformers>=.* (ddplab's text extra)" err.txt && echo "core install: OK"

# deploy/skypilot.yaml read by SkyPilot's own loader and task schema, and broken copies refused
# (deploy/check_skypilot.py). skypilot is some 460 MB with its dependencies and pins versions of its own, so it
# lives in a venv of its own, not in .venv; its installation took 162 s here
# (386 s with other work on the machine: all of make deploy-check's time but 8 s). HOME is a scratch folder: SkyPilot
# writes its state under ~/.sky.
DEPLOY   := .venv-deploy
SKYPILOT := skypilot==0.14.1
deploy-check:
	test -x $(DEPLOY)/bin/python || $(PYTHON) -m venv $(DEPLOY)
	$(DEPLOY)/bin/python -m pip install -q '$(SKYPILOT)'
	HOME=$$(mktemp -d) $(DEPLOY)/bin/python deploy/check_skypilot.py

# After changing what .venv holds on purpose: write the versions it has as the new constraints.
constraints: $(STAMP)
	(echo "# The exact versions the suite is run with; make demo / make test install with -c constraints.txt."; \
	 echo "# Regenerate from a working .venv: make constraints"; \
	 $(PY) -m pip freeze | grep -v -E "^-e |^ddplab") > constraints.txt

clean:
	rm -rf $(VENV) $(CORE) $(DEPLOY) experiments dist build
