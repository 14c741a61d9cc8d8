# The two commands a new user needs (each sets up .venv first, Transformer Engine included):
#   make train [ARGS="key=value ..."]   train the default tiny model on the embedded corpus (CPU is fine)
#   make test                           run the test suite (CPU)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test
setup:
	@bash scripts/setup.sh $(VENV)

train: setup
	$(PY) -m maxlm.train $(ARGS)

test: setup
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS)
