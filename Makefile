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

.PHONY: install demo demo-tracking causal-lm causal-lm-lora test test-main test-fast test-xla xla-env faults bench lint clean chromium deps-check checkov

# The example recipe (examples/recipes) goes in too: the tests run it as an installed plug-in.
$(BIN)/.installed: pyproject.toml examples/recipes/pyproject.toml
	mkdir -p $(VENV)  # the XLA venv's install may be creating it at this moment, as its parent
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile -e ".[dev]"
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

# LoRA adapters on the same base model, fine-tuned on chats; the adapter exported alone too.
causal-lm-lora: install
	test -f $(LM)/base/EXPORTED || $(MAKE) causal-lm
	$(BIN)/trnflow data synth $(LM)/chats --format chat --days 1 --rows-per-day 1000 --holdout-rows 300 \
	  --inference-rows 300 --seed 5
	$(BIN)/trnflow data check jobspecs/examples/causal-lm-lora.yaml
	$(BIN)/trnflow reference jobspecs/examples/causal-lm-lora.yaml
	$(BIN)/trnflow run jobspecs/examples/causal-lm-lora.yaml
	rm -rf $(LM)/adapter
	$(BIN)/trnflow models export causal-lm-lora $(LM)/adapter --adapter -r $(LM)/registry

lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m compileall -q trnflow flows tasks jobspecs benchmarks infra tests

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
	$(CHECKOV_VENV)/bin/checkov --framework cloudformation -f infra/cloudformation/trnflow.yaml --compact --quiet \
	  --skip-download

# The installed set must be consistent (pip check), and the versions the tests ran with are kept in
# runs/tested-with.txt (pip freeze) with the ones that broke Prefect before printed in the log.
deps-check: install
	$(BIN)/python -m pip check
	@mkdir -p runs && $(BIN)/python -m pip freeze --exclude-editable > runs/tested-with.txt
	@echo "tested with: $$(grep -i -E '^(prefect|sqlalchemy|fastapi|starlette|pydantic|torch|moto|boto3)==' \
	  runs/tested-with.txt | tr '\n' ' ')(all in runs/tested-with.txt)"

# The unit tests first (quick, in-process; no browser needed; the `slow` ones wait), then everything
# that starts jobs, flows, servers or a mock cloud.
test-fast: install
	$(BIN)/python -m pytest -n 2 -q -m "unit and not slow" tests/unit

# The XLA lane's environment (about 3 GB to download) is built beside the rest, not after it: `make -j2`
# runs the two branches at once, so its install starts with .venv's (which leaves a core idle) and
# goes on beside the first tests; the lane's tests start when both are done. (Running the lane's
# tests beside the integration tests saves nothing: those keep both cores busy.)
test:
	$(MAKE) -j2 xla-env test-main
	$(MAKE) test-xla

# The slow unit tests (real processes, a 10,000-entry cache) run with the integration tests.
test-main: lint deps-check checkov test-fast chromium
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30 tests/integration \
	  infra/tests tests/unit -m "not unit or slow"

# The XLA lane: torch-xla's CPU runtime (PJRT_DEVICE=CPU) runs the `xla` device's lazy-tensor program
# for real, one rank. It has its own venv, because torch-xla 2.9 needs torch 2.9: about 8 GB (that
# torch wheel pulls in CUDA libraries) and a few minutes to create the first time. Like .venv's,
# its packages are compiled as they are first imported, not on install.
XLA_VENV ?= .venv/xla
XLA_BIN  := $(XLA_VENV)/bin

# Its packages first, beside .venv's install; trnflow itself (editable) only after .venv's, since
# both editable installs write trnflow.egg-info in the checkout.
$(XLA_VENV)/.packages: pyproject.toml tests/xla/requirements.py
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/python -m pip install --quiet --upgrade pip
	$(XLA_BIN)/python -m pip install --quiet --no-compile torch==2.9.0 torch-xla==2.9.0
	$(XLA_BIN)/python tests/xla/requirements.py > $(XLA_VENV)/requirements.txt
	$(XLA_BIN)/python -m pip install --quiet --no-compile -r $(XLA_VENV)/requirements.txt
	touch $@

$(XLA_BIN)/.installed: $(XLA_VENV)/.packages $(BIN)/.installed examples/recipes/pyproject.toml
	$(XLA_BIN)/python -m pip install --quiet --no-deps -e . -e examples/recipes
	touch $@

xla-env: $(XLA_BIN)/.installed

test-xla: $(XLA_BIN)/.installed
	PJRT_DEVICE=CPU $(XLA_BIN)/python -m pytest -n 2 --dist worksteal -q -p no:cacheprovider --durations=8 tests/xla

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
