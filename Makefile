# Two commands do all the set-up: `make serve` and `make test`. Both create .venv and install
# the pinned dependencies (constraints.txt) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: serve test test-fast test-gpu stack stack-down proto docs lock clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[server,dev]'
	touch $(STAMP)

## Start the server on the default model (gpt2; random weights with a warning when offline).
serve: $(STAMP)
	$(BIN)/gpt2serve serve $(ARGS)

## Run the whole test suite (installs the Debian packages the tests use when missing).
test: $(STAMP)
	scripts/debian_test_deps.sh
	$(BIN)/python -m pytest $(ARGS)

## The quick tiers only (no compose stack, browser, Helm tools, fuzzing, GPU or slow tests).
test-fast: $(STAMP)
	scripts/debian_test_deps.sh
	$(BIN)/python -m pytest -m "not (stack or browser or helm or fuzz or flood or gpu or slow or sanitize)" $(ARGS)

## The compose stack with no registry access: installs Docker and compose from Debian when absent,
## starts the engine when none runs, builds every image here (no pulls), waits until healthy.
## GPT2SERVE_MODEL=random:gpt2 make stack   # any model; ports: docker-compose.yml's header
stack: $(STAMP)
	scripts/stack.sh up

## Stop the stack, and the Docker engine if `make stack` started it (volumes are kept).
stack-down:
	scripts/stack.sh down

## On a GPU machine, about 8 minutes: GPU tests, engine and served benches, the suite as time allows (scripts/gpu_check.sh).
test-gpu: $(STAMP)
	scripts/debian_test_deps.sh
	scripts/gpu_check.sh

## Regenerate the checked-in protobuf/gRPC code after editing proto/.
proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

## Rewrite the generated tables in docs/ (flags, metrics, RPCs, routes, statuses).
docs: $(STAMP)
	$(BIN)/python scripts/gen_docs.py

## Re-pin constraints.txt from the current environment.
lock: $(STAMP)
	$(BIN)/pip freeze --exclude-editable --exclude gpt2serve | sed 's/+cpu$$//' | LC_ALL=C sort > constraints.txt

clean:
	rm -rf $(VENV)
