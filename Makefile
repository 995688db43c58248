# Quick start: `make run` (the main job on real MNIST-ST through Flower) and `make test`.
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Decompressed data and Flower's home stay inside the project (ignored by git).
export DPDRO_CACHE_DIR ?= $(CURDIR)/.cache/data
export FLWR_HOME ?= $(CURDIR)/.flwr
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1

.PHONY: install run test test-containers test-all lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/dpdro simulate --config simulations/configs/main.toml --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The image and compose.yaml for real (podman; .ci/install-podman installs it): tests/test_containers.py.
test-containers: $(STAMP)
	CONTAINERS_CONF=$(CURDIR)/containers/containers.conf DPDRO_REQUIRE_CONTAINERS=1 \
		$(BIN)/python -m pytest -q -s -m container tests/test_containers.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/test_architecture.py  # import layers (import-linter contracts in pyproject.toml)

clean:
	rm -rf runs .flwr .pytest_cache
