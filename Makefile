# The developer's whole vocabulary: demo, test, lint, bench (and build-dev).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deps-stamp

.PHONY: demo test test-rust test-loom test-python build build-dev lint bench bench-rust bench-python bench-peers clean stress stress-fork

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Tool and test dependencies, from the project's own pyproject extras.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet "maturin>=1.9,<2"
	touch $(STAMP)

# Build a release wheel and install it: the tests run against the installed package,
# so a file missing from the wheel fails them. `make build PGO=1` (or `make bench PGO=1`)
# builds it profile-guided, trained on the test suite, the way to build a wheel for
# release: it needs an llvm-profdata (scripts/pgo_wheel.py says where it looks) and takes
# minutes.
PGO ?= 0
ifneq ($(filter-out 0 1,$(PGO)),)
$(error PGO is 0 (a plain release build) or 1 (profile-guided), not "$(PGO)")
endif
build: $(STAMP)
	rm -rf dist
ifeq ($(PGO),1)
	$(PY) scripts/pgo_wheel.py --out dist
else
	$(VENV)/bin/maturin build --release --out dist --quiet --interpreter $(PY)
endif
	$(PIP) install --quiet --force-reinstall --no-deps dist/*.whl
	$(PIP) install --quiet "$$(ls dist/*.whl)[test]"

# Editable debug build for quick iteration.
build-dev: $(STAMP)
	$(VENV)/bin/maturin develop

demo: build
	$(PIP) install --quiet "$$(ls dist/*.whl)[lab]"
	$(PY) -m ratequeue demo

test: test-rust test-python

test-rust: test-loom
	cargo test -p ratequeue-core --release
	cargo test -p ratequeue-py --lib

# Model checks (loom) of the core's lock-free protocols: 3 preemptions take seconds (6
# take minutes: LOOM_MAX_PREEMPTIONS=6 make test-loom); a --cfg loom build has a target
# directory of its own so it never invalidates the other.
test-loom:
	RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS="$${LOOM_MAX_PREEMPTIONS:-3}" \
		CARGO_TARGET_DIR="$${CARGO_TARGET_DIR:-target}/loom" \
		cargo test -p ratequeue-core --release --test loom --test loom_fastpath --test loom_batch

test-python: build
	cd tests && ../$(PY) -m pytest -q

# The history checker over >= 10^6 random operations (threads, asyncio tasks, virtual
# time; prints the totals and the violations), then the fork stress when there is one.
# The fork stress test 200 times, the fuzzer with 20,000 mixed examples (an hour's
# timeout: 20,000 examples outlast the suite's 180 s per test on a loaded machine), then
# the history checker over >= 10^6 operations (it reports every violation it finds).
stress: build
	$(MAKE) stress-fork
	cd tests && RATEQUEUE_FUZZ_EXAMPLES=20000 ../$(PY) -m pytest -q --timeout 3600 core/test_fuzz.py
	cd tests && ../$(PY) stress_history.py --ops 1000000 --quiet

# The fork stress test 200 times (forks from many threads while others use every lock).
stress-fork: build
	cd tests && RATEQUEUE_FORK_STRESS_RUNS=200 ../$(PY) -m pytest -q \
		core/test_fork_safety.py -k stress

lint: build
	$(PIP) install --quiet "$$(ls dist/*.whl)[lint]"
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches scripts
	$(VENV)/bin/ruff format --check python tests benches scripts
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest ratequeue._ratequeue --allowlist stubtest-allowlist.txt

# Then the asv suite (against the installed package) when asv is there, and every
# script's markdown gathered into benches/results/RESULTS.md.
bench: bench-rust bench-python bench-peers
	if $(PY) -c "import asv" 2>/dev/null; then \
		cd benches/asv && ../../$(VENV)/bin/asv machine --yes >/dev/null && \
		../../$(VENV)/bin/asv run --python=same --set-commit-hash=$$(git rev-parse HEAD) \
			--show-stderr; \
	fi
	$(PY) benches/report.py --skip compare_peers.py

bench-rust:
	cargo bench -p ratequeue-core --bench bucket

bench-python: build
	$(PIP) install --quiet "$$(ls dist/*.whl)[bench]"
	cd benches && ../$(PY) -m pytest -q bench_*.py --benchmark-only

bench-peers: build
	$(PIP) install --quiet "$$(ls dist/*.whl)[bench]"
	$(PY) benches/compare_peers.py

clean:
	rm -rf $(VENV) dist target
