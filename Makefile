# Distributed Training: Parallel Engineering for LLMs
#   make lab        create the environment if needed, open JupyterLab on your copies of the chapters (lab/)
#   make lab-update the course's new version of chapters you edited (yours kept under lab/previous/)
#   make test       create the environment if needed, run the whole test suite (what CI runs)
#   make test-other-cpu  the tests and nbval again under another CPU's kernels (CI runs it too)
#   make test-browser  every chapter used in the real JupyterLab through headless Chromium (CI runs it too)
#   make mutants    every wrong answer against its exercise check, with a report per exercise
SHELL := /bin/bash
PY := .venv/bin/python
STAMP := .venv/.installed
PYTEST := $(PY) -m pytest
NB_OUT := build/executed
# Two cores shared by the notebook kernel and up to eight ranks: one thread each avoids oversubscription.
export OMP_NUM_THREADS ?= 1
export MPLBACKEND ?= Agg

.PHONY: setup lab lab-update test test-other-cpu test-browser mutants test-unit test-notebooks nbval nbval-executed notebooks grade bench doctor clean

setup: $(STAMP)
$(STAMP): pyproject.toml tools/setup_env.sh
	bash tools/setup_env.sh

# LAB_ARGS: extra options for the server, e.g. LAB_ARGS="--no-browser --port=8890" on a remote machine.
# Containers often run as root, which Jupyter refuses unless told: say so only when it is the case.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
# The lab opens the learner's copies in lab/ (git-ignored, made on first start, refreshed when the course changes
# and the copy was not edited: course_utils/lab.py), so opening, running and saving never touch tracked files.
lab: $(STAMP)
	$(PY) -m course_utils.lab prepare
	$(PY) -m jupyter lab --notebook-dir=. $(ALLOW_ROOT) $(LAB_ARGS) lab/00_overview.ipynb

# CHAPTERS="03 05": those chapters' new versions even if you edited them (default: every edited, outdated copy)
lab-update: $(STAMP)
	$(PY) -m course_utils.lab update $(CHAPTERS)

doctor: $(STAMP)
	$(PY) -m course_utils.doctor

# The linter (ruff, configured in pyproject.toml); unit tests, rank tests under torchrun, grading self-test; then every
# notebook headless once (papermill, as `make notebooks` runs them) and that execution held to the committed outputs
# by nbval's rules (tests/nbval_executed.py). One execution serves both (before, nbval executed every chapter a
# second time beside papermill: the two side by side took about 750 s of make test's 1630 on 2 cores).
# The tests run in two worker processes (pytest-xdist, TEST_JOBS; 0: in this one): a rank test's processes keep about
# 1.14 of 2 cores busy (the rest is waiting on rank starts and messages), so two at once took the 3109 tests from
# 1220 s to 814 s on 2 cores. A test must not depend on being alone (docs/CONTRIBUTING.md says how).
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m ruff check .
	$(PYTEST) -q -n $(TEST_JOBS)
	$(PY) -m course_utils.notebooks check
	$(MAKE) --no-print-directory test-notebooks
	$(MAKE) --no-print-directory nbval-executed

# Every chapter headless into build/executed (papermill), the run a learner's `make notebooks` does in place; two
# chapters at once (NB_JOBS), longest first: one chapter's kernel and ranks keep about 1.2 of 2 cores busy (the rest
# waits on rank starts and messages), so two at once took make test's executions from about 705 s to about 470.
NB_JOBS ?= 2
test-notebooks: $(STAMP)
	$(PY) -m course_utils.notebooks execute --out $(NB_OUT) --timeout 600 --jobs $(NB_JOBS)

# Those executed chapters' outputs compared with the committed ones, cell by cell, with nbval's rules and sanitizers.
NBVAL := $(PYTEST) -q -p no:cacheprovider -p tests.nbval_executed --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg
nbval-executed: $(STAMP)
	$(NBVAL) --nbval-executed $(NB_OUT) notebooks/*.ipynb

# nbval on its own: every chapter re-executed in a kernel of nbval's and compared with the committed outputs. A cell
# may take 600 s (cold-starting ranks on a loaded machine); pytest-timeout backs it up at 660.
nbval: $(STAMP)
	COURSE_FIGURES_DIR=$(CURDIR)/$(NB_OUT)/nbval-figures COURSE_SCRATCH_DIR=$(CURDIR)/$(NB_OUT)/nbval-scratch \
		$(NBVAL) -o timeout=660 --nbval-current-env --nbval-cell-timeout=600 notebooks/*.ipynb

# The same tests and nbval comparisons once more under another CPU's kernels: AVX2 on an AVX-512 machine, the
# plain ones on any other (course_utils.cpu_spread.second_variant). A learner's laptop rounds differently from
# this machine, so what a test or a stored output asserts must hold there too. CI runs it after `make test`.
# Tests marked `load` or `once` assert nothing the kernels can change (processes, the grader, the lab server, the
# wrong answers' verdicts): `make test` runs them, this pass does not, which keeps CI under an hour on 2 cores.
# Its chapters run two at a time as in make test (CI runs this pass beside test-browser, which mostly waits).
test-other-cpu: $(STAMP)
	@echo "other CPU kernels: $$($(PY) -m course_utils.cpu_spread --second-variant-env)"
	env $$($(PY) -m course_utils.cpu_spread --second-variant-env) $(PYTEST) -q -n $(TEST_JOBS) -p no:cacheprovider -m "not browser and not load and not once"
	env $$($(PY) -m course_utils.cpu_spread --second-variant-env) \
		$(PY) -m course_utils.notebooks execute --out $(NB_OUT)/other-cpu --timeout 600 --jobs $(NB_JOBS)
	$(NBVAL) --nbval-executed $(NB_OUT)/other-cpu notebooks/*.ipynb

# A learner's session in a real browser, in one make lab: chapter 05 in depth (its widget, a refusal, a kernel
# restart; Cancel, interrupt and a crashed rank), then every chapter: Run All, every widget moved, one exercise
# answered wrong, saved, tab closed and its ranks gone after the idle time; no tracked file changed. Screenshots
# of every widget go to build/browser/. Needs Chromium (Debian: apt-get install chromium; or CHROMIUM=/path);
# .ci/run installs it.
test-browser: $(STAMP)
	$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install -q --disable-pip-version-check "playwright>=1.40"
	$(PYTEST) -q -s -p no:cacheprovider -m browser tests/browser

# Every wrong answer in tests/wrong_answers/ against its exercise's check, with a report per exercise of which
# ones the check catches and with the right reason (make test runs the same tests and prints the same report).
mutants: $(STAMP)
	$(PYTEST) -q -p no:cacheprovider tests/test_exercises.py -k wrong_answer_is_caught

test-unit: $(STAMP)
	$(PYTEST) -q -n $(TEST_JOBS)

notebooks: $(STAMP)
	$(PY) -m course_utils.notebooks execute

grade: $(STAMP)
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=path/to/notebooks [OUT=grades]"; exit 2; }
	$(PY) -m course_utils.grade $(SUBMISSIONS) --out $(or $(OUT),grades)

bench: $(STAMP)
	$(PY) -m course_utils.bench

clean:
	rm -rf build .pytest_cache
