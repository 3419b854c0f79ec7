# One command for the main job, one for the tests; each sets up what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.moe-gmm-installed

.PHONY: setup validate test bench clean

setup: $(STAMP)

# --system-site-packages: a torch already installed for this python (a CUDA or NPU build, say)
# is reused; only when none is importable does the CPU wheel torch==2.13.0 get installed.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[test]"
	$(PY) -m moe_gmm.ops.native
	touch $(STAMP)

validate: $(STAMP)
	$(VENV)/bin/moe-gmm validate --quick

test: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-2} $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks.run_gmm --quick --out out/bench/gmm_quick.json

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
