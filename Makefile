# The two commands a new user needs (each sets up .venv first: scripts/setup.sh, Transformer Engine included
# when a prebuilt wheel or a CUDA toolkit is there, else without it, saying so in one line):
#   make train [ARGS="key=value ..."]   train the default model (configs/default.yml, ~2 min on 2 cores) on the embedded corpus
#   make test                           run the test suite (CPU)
#   make mutation                       mutation testing of the core (slow, not in `make test`; docs/mutation.md)
#   make test-hf                        the live comparison with transformers (adds CPU torch to the venv; not in `make test`)
#   make test-container                 build the image (docker/) with podman and test it (root; not in `make test`)
#   make convergence / test-convergence the cpu convergence tier / its own training tests (not in `make test`)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test lint mutation test-container test-wheel test-hf convergence test-convergence
setup:
	@bash scripts/setup.sh $(VENV)

train: setup
	$(PY) -m maxlm.train config=default.yml $(ARGS)

# Convergence suite (docs/convergence.md): SUITE=cpu (CI tier, default) or gpu (the H200); ARGS: overrides
# for every case; report, loss_curves.png, results.json and junit.xml in runs/convergence/<suite>.
convergence: setup
	$(PY) -m maxlm.tools.convergence run suite=$(or $(SUITE),cpu) $(ARGS)

# The convergence suite's own tests that train (tests/test_convergence.py, marker `convergence`): the tiny
# cases pass clean, and each injected bug (RoPE without positions, targets shifted by one token, learning
# rate x30) fails its case. ~4 CPU-minutes, so not in `make test`; CI runs it after `make convergence`.
test-convergence: setup
	$(PY) -m pytest -q -m convergence tests/test_convergence.py $(PYTEST_ARGS)

# The linter (ruff, configured in pyproject.toml): part of `make test`, before the suite.
lint: setup
	$(PY) -m ruff check .

# --dist loadgroup: tests marked xdist_group(name) run on one worker (tests/test_launch.py shares its runs);
# -rs: the summary lists every skipped test with its reason
# --max-worker-restart=0: a worker that dies ends the run with its report (tests/conftest.py prints the test and the
# stacks) instead of a replacement worker; once (2026-12-04) the replacement never started a test and the run hung.
test: setup lint
	$(PY) -m pytest -q -rs -n 2 --dist loadgroup --max-worker-restart=0 $(PYTEST_ARGS)

# The image on a Debian + Python base made here (scripts/build_image.sh), then `maxlm doctor` and a 5-step train
# inside it (tests/test_container.py; times in docker/README.md). CI runs it after the main suite.
# MAXLM_TEST_IMAGE=<tag> tests an image built before instead of building one.
test-container: setup
	$(PY) -m pytest -q -m container tests/test_container.py $(PYTEST_ARGS)

# The live comparison with transformers (tests/test_hf.py, marker `hf`): scripts/setup_hf.sh adds CPU torch and
# transformers (the versions tests/golden/hf/versions.json records) to the venv, then a fresh random Llama and
# Mistral made by transformers must give maxlm's logits and greedy tokens. `make test` runs these two tests too once
# torch is there, and skips them with the reason where it is not.
test-hf: setup
	@bash scripts/setup_hf.sh $(VENV)
	$(PY) -m pytest -q -rs -m hf tests/test_hf.py $(PYTEST_ARGS)

# The installed package outside the source tree: `pip wheel .`, a fresh venv, then `maxlm train config=default.yml`,
# a llama8b dry run, `maxlm doctor` and `from maxlm import Model` from an empty directory (tests/test_wheel.py).
test-wheel: setup
	$(PY) -m pytest -q -m wheel tests/test_wheel.py $(PYTEST_ARGS)

# Mutation score per module and the surviving mutants (mutmut; a full run is several hours on 2 cores, see docs/mutation.md). MUTANTS='maxlm.optim*' runs
# only those mutants (reusing mutants/); MUTATION_CHILDREN=2 by default.
mutation: setup
	VENV=$(VENV) bash scripts/mutation.sh $(MUTANTS)
