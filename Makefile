# The two commands: `make demo` runs the quickstart pipeline on the emulator, `make test` runs the tests.
# Both create .venv on first use and reinstall when pyproject.toml changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
SPEC   ?= jobspecs/examples/quickstart.yaml
DATA   ?= runs/quickstart/data

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false

.PHONY: install demo test test-fast faults lint clean chromium

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(BIN)/.installed

$(DATA)/holdout:
	$(BIN)/trnflow data synth $(DATA) --days 3 --rows-per-day 1500 --seed 7

demo: install $(DATA)/holdout
	$(BIN)/trnflow validate $(SPEC)
	$(BIN)/trnflow reference $(SPEC)
	$(BIN)/trnflow run $(SPEC)

lint: install
	$(BIN)/ruff check .
	$(BIN)/python -m compileall -q trnflow flows tasks jobspecs benchmarks infra tests

# The UI test screenshots a deployment page with Debian's chromium: installed here where apt-get
# can (as root); elsewhere that one test is skipped and says why.
chromium:
	@command -v chromium >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
	  echo "chromium could not be installed: the UI screenshot test will be skipped"

# The unit tests first (quick, in-process; no browser needed), then everything that starts jobs,
# flows, servers or a mock cloud.
test-fast: install
	$(BIN)/python -m pytest -n 2 -q -m unit tests/unit

test: lint test-fast chromium
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15 tests/integration infra/tests

# The fault matrix: the quickstart pipeline (shortened) once without faults, then once per fault, each
# compared with the fault-free run. About 25 minutes on 2 cores; `make test` runs its CI case.
faults: install
	$(BIN)/python -m tests.faults --json runs/faults.json

clean:
	rm -rf runs .trnflow
