# The two commands: `make demo` runs the quickstart pipeline on the emulator, `make test` runs the tests.
# Both create .venv on first use and reinstall when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SPEC   ?= jobspecs/examples/quickstart.yaml
DATA   ?= runs/quickstart/data

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

# The venvs are installed without byte-compiling (pip's compile of every module of torch, Prefect,
# moto and the rest is most of an install: about 100 of its 150 CPU seconds). A module is compiled
# when first imported instead, and its bytecode kept for the next process, so a machine that sets
# PYTHONDONTWRITEBYTECODE (many CI images do) has it left out of everything run from here: there,
# every process would compile what it imports from source again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo demo-tracking causal-lm causal-lm-lora test test-main test-fast test-unit-beside test-xla test-xla-beside \
  xla-env xla-packages-beside checkov-beside faults bench lint clean chromium deps-check deps-verify deps-update checkov

# Each environment installs the versions the suite last passed with (requirements/lock.txt, and
# requirements/xla-lock.txt for the XLA lane), as pip's constraints: a release on the registry
# changes nothing here until `make deps-update` has run the suite on it. LOCKED=no resolves afresh.
LOCK     ?= requirements/lock.txt
XLA_LOCK ?= requirements/xla-lock.txt
LOCKED   ?= yes
XLA_VENV ?= $(VENV)/xla
XLA_BIN  := $(XLA_VENV)/bin
locked    = $(if $(filter yes,$(LOCKED)),-c $(1))

# The example recipe (examples/recipes) goes in too: the tests run it as an installed plug-in.
$(BIN)/.installed: pyproject.toml examples/recipes/pyproject.toml $(LOCK)
	mkdir -p $(VENV)  # the XLA venv's install may be creating it at this moment, as its parent
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile $(call locked,$(LOCK)) -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps -e examples/recipes
	touch $@

install: $(BIN)/.installed

$(DATA)/holdout:
	$(BIN)/trnflow data synth $(DATA) --days 3 --rows-per-day 1500 --seed 7

demo: install $(DATA)/holdout
	$(BIN)/trnflow validate $(SPEC)
	$(BIN)/trnflow reference $(SPEC)
	$(BIN)/trnflow run $(SPEC)

# The demo's run mirrored to a local MLflow server, left running to browse (its URL is printed;
# `kill $$(cat runs/mlflow/server.pid)` stops it), and its TensorBoard event files written.
MLFLOW_PORT ?= 5000
demo-tracking: install $(DATA)/holdout
	mkdir -p runs/mlflow
	$(BIN)/trnflow tracking server --port $(MLFLOW_PORT) --folder runs/mlflow > runs/mlflow/server.log 2>&1 & \
	  echo $$! > runs/mlflow/server.pid
	$(BIN)/trnflow reference $(SPEC)
	for i in $$(seq 120); do $(BIN)/trnflow validate $(SPEC) --data-check --set \
	  tracking.mlflow_uri=http://127.0.0.1:$(MLFLOW_PORT) > /dev/null 2>&1 && break; sleep 1; done
	$(BIN)/trnflow validate $(SPEC) --data-check --set tracking.mlflow_uri=http://127.0.0.1:$(MLFLOW_PORT)
	$(BIN)/trnflow run $(SPEC) --set tracking.mlflow_uri=http://127.0.0.1:$(MLFLOW_PORT) \
	  --set tracking.tensorboard=true
	@echo "MLflow: http://127.0.0.1:$(MLFLOW_PORT) (experiment quickstart; stop it: kill \$$(cat runs/mlflow/server.pid))"

# Fine-tuning a pretrained language model: a tiny model of review text trained from scratch and
# exported (the "pretrained" one), then fine-tuned on prompt/completion pairs, gated on perplexity.
LM := runs/causal-lm
causal-lm: install
	$(BIN)/trnflow data synth $(LM)/reviews --days 1 --rows-per-day 2000 --inference-rows 200 --seed 3
	$(BIN)/trnflow data synth $(LM)/prompts --format prompt-completion --days 1 --rows-per-day 1000 \
	  --holdout-rows 300 --inference-rows 300 --seed 5
	$(BIN)/trnflow run jobspecs/examples/causal-lm-base.yaml
	rm -rf $(LM)/base
	$(BIN)/trnflow models export causal-lm-base $(LM)/base -r $(LM)/registry
	$(BIN)/trnflow reference jobspecs/examples/causal-lm.yaml
	$(BIN)/trnflow run jobspecs/examples/causal-lm.yaml
	rm -rf $(LM)/tuned
	$(BIN)/trnflow models export causal-lm $(LM)/tuned -r $(LM)/registry

# LoRA adapters on the fine-tuned model, trained on chats; the adapter exported alone too.
causal-lm-lora: install
	test -f $(LM)/tuned/EXPORTED || $(MAKE) causal-lm
	$(BIN)/trnflow data synth $(LM)/chats --format chat --days 1 --rows-per-day 1000 --holdout-rows 300 \
	  --inference-rows 300 --seed 5
	$(BIN)/trnflow data check jobspecs/examples/causal-lm-lora.yaml
	$(BIN)/trnflow reference jobspecs/examples/causal-lm-lora.yaml
	$(BIN)/trnflow run jobspecs/examples/causal-lm-lora.yaml
	rm -rf $(LM)/adapter
	$(BIN)/trnflow models export causal-lm-lora $(LM)/adapter --adapter -r $(LM)/registry

lint: install
	$(call mark,lint,start)
	$(BIN)/ruff check .
	$(BIN)/python -m compileall -q trnflow flows tasks jobspecs benchmarks infra tests
	$(call mark,lint,end)

# The UI test screenshots a deployment page with Debian's chromium: installed here where apt-get
# can (as root); elsewhere that one test is skipped and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium could not be installed: the UI screenshot test will be skipped"

# checkov, the infrastructure scanner, on the CloudFormation template: every finding fails, and a check
# the template skips says why beside it. It has a venv of its own (its pins clash with the project's).
CHECKOV_VENV ?= .venv/checkov
$(CHECKOV_VENV)/.installed:
	mkdir -p $(VENV)
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install --quiet --no-compile "checkov==3.3.30"
	touch $@

checkov: $(CHECKOV_VENV)/.installed
	$(CHECKOV_VENV)/bin/checkov --framework cloudformation -f infra/cloudformation/trnflow.yaml \
	  -f infra/cloudformation/team.yaml --compact --quiet --skip-download

# The installed set must be consistent (pip check) and exactly the lock's.
deps-verify: install
	$(BIN)/python -m pip check
	$(if $(filter yes,$(LOCKED)),$(PYTHON) -m tests.deps verify $(BIN)/python $(LOCK))

# How far the locks are behind the registry (asks it for every package's newest release).
deps-check: install $(XLA_BIN)/.installed
	$(PYTHON) -m tests.deps behind $(BIN)/python $(LOCK)
	$(PYTHON) -m tests.deps behind $(XLA_BIN)/python $(XLA_LOCK)

# Resolve every environment afresh (in .venv/next), run the whole suite there, and only when it
# passes write the new locks; `make install` then moves .venv to them.
NEXT := .venv/next
deps-update:
	rm -rf $(NEXT)
	$(MAKE) test VENV=$(NEXT) LOCKED=no
	$(PYTHON) -m tests.deps write $(NEXT)/bin/python $(LOCK) --name "the project's environment (.venv)"
	$(PYTHON) -m tests.deps write $(NEXT)/xla/bin/python $(XLA_LOCK) --name "the XLA lane's environment (.venv/xla)"
	rm -rf $(NEXT)

# Where the time goes: each pytest run writes its tests' workers, starts and durations here, and
# each phase of `make test` (and of CI) its start and end; `python -m tests.timeline summary
# $(TIMELINE)` prints the phases' wall times and the 20 slowest tests.
TIMELINE ?= runs/test-timeline
mark      = $(PYTHON) -m tests.timeline mark $(TIMELINE) $(1) $(2)
timeline  = -p tests.timeline --timeline $(TIMELINE)/$(1).jsonl

# The unit tests (quick, in-process; no browser needed; the `slow` ones run with the integration tests).
test-fast: install
	$(call mark,unit,start)
	$(BIN)/python -m pytest -n 2 -q -m "unit and not slow" tests/unit $(call timeline,unit)
	$(call mark,unit,end)

# `make test` runs its branches at once (`make -j5`): the integration tests after lint, the lock check
# and chromium; the unit tests, from the start, beside them; checkov's venv (20 s of one CPU, made
# beside them: its scan, one of the integration tests, waits for it); and the XLA lane (its
# environment, about 3 GB to download, then its tests). The XLA lane's install and tests run at the
# lowest priority (nice 19), on the CPU the integration tests leave idle while they wait on servers,
# schedules and job processes (a fifth of the integration phase); its Prefect server does not (one
# started inside the lane once starved past its 120 s start-up timeout): tests/prefect_server.py
# starts it first, at the usual priority, in a session of its own. The unit tests and checkov's
# install at nice 10, which leaves them a tenth of a busy CPU (their subprocesses have timeouts),
# where at the integration tests' priority they took a third of the CPU for their first minute.
# A nice value counts only within a session, and local jobs stay in their submitter's (see
# trnflow/backends/local.py). At nice 10 the lane still made the integration phase 2:19 longer
# (26:55 against 24:36), and when each job had a session of its own, 4 minutes longer (29:37
# against 25:40). The unit tests' and the lane's outputs are kept in $(TIMELINE)/unit.log and
# xla.log, each printed whole when its branch ends.
# The timeline starts afresh and its summary is printed at the end, unless CI (TIMELINE_OF=ci), whose
# phases surround these, does both.
TIMELINE_OF ?= make
test:
	$(if $(filter make,$(TIMELINE_OF)),rm -rf $(TIMELINE))
	$(MAKE) -j5 test-xla-beside test-unit-beside checkov-beside test-main CHECKOV_BESIDE=yes
	$(if $(filter make,$(TIMELINE_OF)),@$(PYTHON) -m tests.timeline summary $(TIMELINE))

test-unit-beside: install
	@mkdir -p $(TIMELINE)
	@nice -n 10 $(MAKE) --no-print-directory test-fast > $(TIMELINE)/unit.log 2>&1; status=$$?; \
	  echo "--- the unit tests (make test-fast, beside the other tests), exit $$status:"; cat $(TIMELINE)/unit.log; \
	  exit $$status

# The lane's environment is made at the lane's priority too: its packages (a minute and a half of
# one CPU, 16 GB written) beside .venv's install, then trnflow into it once .venv has it.
xla-packages-beside:
	@nice -n 19 $(MAKE) --no-print-directory $(XLA_VENV)/.packages

test-xla-beside: xla-packages-beside $(BIN)/.installed
	@mkdir -p $(TIMELINE)
	@$(BIN)/python -m tests.prefect_server -- nice -n 19 $(MAKE) --no-print-directory test-xla \
	  > $(TIMELINE)/xla.log 2>&1; status=$$?; \
	  echo "--- the XLA lane (make test-xla, beside the other tests), exit $$status:"; cat $(TIMELINE)/xla.log; \
	  exit $$status

checkov-beside:
	@nice -n 10 $(MAKE) --no-print-directory $(CHECKOV_VENV)/.installed

# The slow unit tests (real processes, a 10,000-entry cache) run with the integration tests; checkov's
# scan is one of them (infra/tests/test_roles.py), run in the venv made before them, or beside them
# (CHECKOV_BESIDE=yes, as `make test` runs them), when the scan waits for it.
CHECKOV_BESIDE ?= no
test-main: lint deps-verify chromium $(if $(filter yes,$(CHECKOV_BESIDE)),,$(CHECKOV_VENV)/.installed)
	$(call mark,integration,start)
	TRNFLOW_TEST_CHECKOV_BESIDE=$(CHECKOV_BESIDE) $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder \
	  --durations=30 tests/integration infra/tests tests/unit -m "not unit or slow" $(call timeline,integration)
	$(call mark,integration,end)

# The XLA lane: torch-xla's CPU runtime (PJRT_DEVICE=CPU) runs the `xla` device's lazy-tensor program
# for real, one rank. It has its own venv, because torch-xla 2.9 needs torch 2.9: about 8 GB (that
# torch wheel pulls in CUDA libraries) and a few minutes to create the first time. Like .venv's,
# its packages are compiled as they are first imported, not on install.
# Its packages first, beside .venv's install; trnflow itself (editable) only after .venv's, since
# both editable installs write trnflow.egg-info in the checkout.
$(XLA_VENV)/.packages: pyproject.toml tests/xla/requirements.py $(XLA_LOCK)
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/python -m pip install --quiet --upgrade pip
	$(XLA_BIN)/python -m pip install --quiet --no-compile $(call locked,$(XLA_LOCK)) torch==2.9.0 torch-xla==2.9.0
	$(XLA_BIN)/python tests/xla/requirements.py > $(XLA_VENV)/requirements.txt
	$(XLA_BIN)/python -m pip install --quiet --no-compile $(call locked,$(XLA_LOCK)) -r $(XLA_VENV)/requirements.txt
	$(if $(filter yes,$(LOCKED)),$(PYTHON) -m tests.deps verify $(XLA_BIN)/python $(XLA_LOCK))
	touch $@

$(XLA_BIN)/.installed: $(XLA_VENV)/.packages $(BIN)/.installed examples/recipes/pyproject.toml
	$(XLA_BIN)/python -m pip install --quiet --no-deps -e . -e examples/recipes
	touch $@

xla-env: $(XLA_BIN)/.installed

test-xla: $(XLA_BIN)/.installed
	$(call mark,xla,start)
	PJRT_DEVICE=CPU $(XLA_BIN)/python -m pytest -n 2 --dist worksteal -q -p no:cacheprovider --durations=8 tests/xla \
	  $(call timeline,xla)
	$(call mark,xla,end)

# The fault matrix: the quickstart pipeline (shortened) once without faults, then once per fault, each
# compared with the fault-free run. About 30 minutes on 2 cores; `make test` runs its two CI cases.
faults: install
	$(BIN)/python -m tests.faults --json runs/faults.json

# Every benchmark against its baseline: runs/bench/results.json, a plot per benchmark and a table of
# ratios. About an hour on 2 cores, 23 minutes of it precision's 40 training runs (two at a time);
# `$(BIN)/python benchmarks/bench.py --only NAME ...` runs some, keeping the rest.
bench: install
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf runs .trnflow
