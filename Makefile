# Two commands do all set-up from a fresh clone: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
RUNTIME := $(VENV)/.runtime
STAMP := $(VENV)/.installed
FRAMEWORKS := $(VENV)/.frameworks
DOCS := $(VENV)/.docs

.PHONY: demo docs test test-fast bench bench-gpu schemas fixtures lint clean

# Packages are installed with uv (into the venv, by pip, first): torch unpacks in seconds rather than
# half a minute. uv reads no pip.conf; it takes pip's find-links and indexes from the PIP_FIND_LINKS,
# PIP_INDEX_URL and PIP_EXTRA_INDEX_URL variables (where a local torch wheel or a mirror may be).
UV := $(VENV)/bin/uv
UV_INSTALL := $(UV) pip install -q --python $(PY) -c constraints.txt
empty :=
space := $(empty) $(empty)
comma := ,
ifneq ($(strip $(PIP_FIND_LINKS)),)
export UV_FIND_LINKS ?= $(subst $(space),$(comma),$(strip $(PIP_FIND_LINKS)))
endif
ifneq ($(strip $(PIP_INDEX_URL)),)
export UV_INDEX_URL ?= $(PIP_INDEX_URL)
endif
ifneq ($(strip $(PIP_EXTRA_INDEX_URL)),)
export UV_EXTRA_INDEX_URL ?= $(PIP_EXTRA_INDEX_URL)
export UV_INDEX_STRATEGY ?= unsafe-best-match  # pip's choice: the best version across every index
endif

# What the demo needs: ckptkit with torch and safetensors, nothing of the development tools.
$(RUNTIME): pyproject.toml constraints.txt ckptkit/ops/_changed.c
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt uv
	$(UV_INSTALL) -e '.[torch]'
	touch $(RUNTIME)

# The tests' and linters' dependencies on top (transformers, peft, tensorstore, zarr, boto3, mypy, ...).
$(STAMP): $(RUNTIME)
	$(UV_INSTALL) -e '.[dev]'
	touch $(STAMP)

# The frameworks the tests load exports into (not needed to run ckptkit or the demo).
$(FRAMEWORKS): $(STAMP)
	$(PY) -m pip install -q --no-deps -c constraints.txt megatron-core  # the Megatron export's tests load into megatron-core
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt deepspeed  # the DeepSpeed export's tests load into DeepSpeed (pure-Python install; its CPU op is built at first use)
	$(PY) -m pip install -q --no-deps -c constraints.txt torchtitan spmd_types triton tyro docstring_parser typeguard  # the torchtitan tests resume torchtitan's job (its models import triton)
	touch $(FRAMEWORKS)

# The docs site's builder (mkdocs and its plugins), on top of the runtime: the API pages import ckptkit.
$(DOCS): $(RUNTIME)
	$(UV_INSTALL) -e '.[docs]'
	touch $(DOCS)

demo: $(RUNTIME)
	$(VENV)/bin/ckptkit demo demo-out

test: $(FRAMEWORKS)
	$(PY) -m mypy
	$(PY) -m pytest -q

test-fast: $(FRAMEWORKS)
	$(PY) -m pytest -q -m "not multiprocess and not slow"

bench: $(STAMP)
	$(PY) -m benchmarks.run

# Needs a CUDA device (exits 2 without one); see README, Development.
bench-gpu: $(STAMP)
	$(PY) benchmarks/gpu.py

# The docs site into site/; warnings (a broken link, anchor or API reference) fail the build.
docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

schemas: $(STAMP)
	$(PY) -m ckptkit.schemas schemas

# fixtures/megatron-lm/ is not made here: it needs Megatron-LM's source tree and its own environment
# (fixtures/README.md): PYTHONPATH=../Megatron-LM ../mlm-env/bin/python fixtures/make_megatron_lm.py
fixtures: $(STAMP)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e '.[fixtures]'
	$(PY) -m pip install -q --no-deps -c constraints.txt megatron-core
	$(PY) fixtures/make_fixtures.py
	$(PY) fixtures/make_dcp.py
	$(PY) fixtures/make_deepspeed.py
	$(PY) fixtures/make_megatron.py
	$(PY) fixtures/make_hf.py

lint: $(STAMP)
	$(PY) -m mypy

clean:
	rm -rf $(VENV) demo-out bench-out site
