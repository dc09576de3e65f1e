# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and exactly pinned: a looser requirement pulls a multi-GB build on some machines.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/agora demo --preset small --stages 3 --replicas 2 --steps 20 --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q -x --timeout=600 tests

clean:
	rm -rf $(VENV) runs .pytest_cache
