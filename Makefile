# deepep_cupy: make test | lint | bench | soak | soak-cases | soak-sequences | soak-internode | install | clean |
#              distclean | which
#
# Which Python runs things:
#   * $(PYTHON) (default python3) itself, when it can already import cupy, mpi4py, numpy and
#     pytest (e.g. a GPU machine set up by hand, maybe offline): nothing is installed and the
#     checkout is put on PYTHONPATH;
#   * otherwise a virtual environment $(VENV), made from $(PYTHON), into which
#     `pip install -e .[$(EXTRAS)]` runs once (and again whenever pyproject.toml changes, or
#     EXTRAS given on the command line differs from what was installed).
# An existing $(VENV) is used when PYTHON is not given. Force a choice with USE_VENV=1 or 0.
# The targets that need a GPU (bench and the soaks) first ask the NVIDIA driver, with $(PYTHON) and
# the standard library alone (deepep_cupy/driver_check.py): without a GPU they stop in one sentence
# before $(VENV) is made or anything is installed (`make bench BENCH_ARGS=--help` does not ask).
#
# Examples: make test PYTEST_ARGS='-k comm'   make bench BENCH_ARGS='--help'
#           make test PYTHON=python3.12       make install EXTRAS=cuda13,test
#           make install EXTRAS=cuda12,test   (without PyTorch and matplotlib: their tests skip)
#           make soak-cases SOAK_SEED=1234 SOAK_CASES=1   (one random case alone: a failing seed)
#           make soak-sequences SOAK_SEQUENCE_SEED=1234 SOAK_SEQUENCES=1   (one sequence alone)
#           make soak-internode SOAK_INTERNODE_SEED=1234 SOAK_INTERNODE_CASES=1   (one internode case alone)

PYTHON      ?= python3
VENV        ?= .venv
# Extras (pyproject.toml): cuda12 or cuda13, test; torch and plots are optional (their tests skip
# without them, and `make test` says so).
EXTRAS      ?= cuda12,test,torch,plots
PYTEST_ARGS ?=
BENCH_ARGS  ?=
# make soak runs the random-case soak, the sequence soak, then the internode soak; soak-cases,
# soak-sequences and soak-internode run one of them alone.
# The random-case soak (tests/workers/random_soak.py): seeds SOAK_SEED .. SOAK_SEED+SOAK_CASES-1
# (make test runs seeds 0..49); SOAK_ARGS: e.g. --gpus 2, --timeout 20, --list.
SOAK_CASES  ?= 1000
SOAK_SEED   ?= 1000
SOAK_ARGS   ?=
# The sequence soak (tests/workers/sequence_soak.py): SOAK_SEQUENCES sequences of SOAK_STEPS calls on
# one Buffer, seeds SOAK_SEQUENCE_SEED .. +SOAK_SEQUENCES-1 (make test runs 20 of 50 steps, seeds
# 0..19); SOAK_SEQUENCE_ARGS: e.g. --gpus 2, --timeout 20, --records, --list.
SOAK_SEQUENCES     ?= 200
SOAK_STEPS         ?= 50
SOAK_SEQUENCE_SEED ?= 1000
SOAK_SEQUENCE_ARGS ?=
# The internode soak (tests/workers/internode_soak.py): random internode cases over simulated nodes,
# seeds SOAK_INTERNODE_SEED .. +SOAK_INTERNODE_CASES-1, under mpiexec with the MPI transport (ranks
# share GPU 0 when there are fewer GPUs than ranks; make test runs seeds 0..19);
# SOAK_INTERNODE_ARGS: e.g. --timeout 60, --records, --list.
SOAK_INTERNODE_CASES ?= 200
SOAK_INTERNODE_SEED  ?= 1000
SOAK_INTERNODE_ARGS  ?=
PIP_FLAGS   ?=

REPO    := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV_PY := $(VENV)/bin/python
STAMP   := $(VENV)/.deepep-cupy-installed
PROBE   := import cupy, mpi4py, numpy, pytest

ifndef USE_VENV
  ifeq ($(origin PYTHON),file)
    ifneq ($(wildcard $(VENV_PY)),)
      USE_VENV := 1
    endif
  endif
endif
ifndef USE_VENV
  USE_VENV := $(if $(shell $(PYTHON) -c '$(PROBE)' >/dev/null 2>&1 && echo ok),0,1)
endif

ifeq ($(USE_VENV),1)
  PY    := $(VENV_PY)
  SETUP := $(STAMP)
else
  PY    := $(PYTHON)
  SETUP :=
endif

# The checkout comes first on the import path (no install needed, and it wins over stale installs).
export PYTHONPATH := $(REPO)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: test lint bench soak soak-cases soak-sequences soak-internode install clean distclean which gpu-driver

# The goals that need a GPU. When one is asked for, gpu-driver runs before anything else: it is an
# order-only prerequisite of the venv and of the install stamp too, so that even `make -j` asks the
# driver before it installs.
GPU_GOALS  := bench soak soak-cases soak-sequences soak-internode
GPU_GOAL   := $(firstword $(filter $(GPU_GOALS),$(MAKECMDGOALS)))
NEEDS_GPU  := $(if $(GPU_GOAL),$(if $(filter -h --help,$(BENCH_ARGS)),,1))
GPU_FIRST  := $(if $(NEEDS_GPU),gpu-driver)

gpu-driver:
	@$(PYTHON) $(REPO)/deepep_cupy/driver_check.py "make $(or $(GPU_GOAL),gpu-driver)"

# One line before the tests when an optional package is missing: which tests skip, and how to add it.
define OPTIONAL_NOTE
import importlib.util, sys
missing = [(name, extra) for module, name, extra in (("torch", "PyTorch", "torch"), ("matplotlib", "matplotlib", "plots"))
           if importlib.util.find_spec(module) is None]
if missing:
    names, extras = " and ".join(n for n, _ in missing), ",".join(e for _, e in missing)
    how = f"make install EXTRAS={sys.argv[1]},{extras}" if sys.argv[2] == "1" else f"pip install -e '.[{extras}]'"
    are, its, it = ("are", "their", "them") if len(missing) > 1 else ("is", "its", "it")
    print(f"make test: {names} {are} not installed, so {its} tests skip; `{how}` adds {it}")
endef
export OPTIONAL_NOTE

test: $(SETUP)
	@$(PY) -c "$$OPTIONAL_NOTE" '$(EXTRAS)' '$(USE_VENV)'
	$(PY) -m pytest -q -ra tests $(PYTEST_ARGS)

# ruff and mypy come with the test extra; on a machine set up by hand, install them there
# (pip install 'ruff>=0.17,<0.18' mypy==1.13.0). mypy reads its settings from pyproject.toml.
lint: $(SETUP)
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(GPU_FIRST) $(SETUP)
	$(PY) -m deepep_cupy.bench $(BENCH_ARGS)

soak: soak-cases soak-sequences soak-internode

soak-cases: $(GPU_FIRST) $(SETUP)
	$(PY) tests/workers/random_soak.py --cases $(SOAK_CASES) --seed $(SOAK_SEED) $(SOAK_ARGS)

soak-sequences: $(GPU_FIRST) $(SETUP)
	$(PY) tests/workers/sequence_soak.py --sequences $(SOAK_SEQUENCES) --steps $(SOAK_STEPS) \
		--seed $(SOAK_SEQUENCE_SEED) $(SOAK_SEQUENCE_ARGS)

soak-internode: $(GPU_FIRST) $(SETUP)
	$(PY) tests/workers/internode_soak.py --cases $(SOAK_INTERNODE_CASES) --seed $(SOAK_INTERNODE_SEED) \
		$(SOAK_INTERNODE_ARGS)

ifeq ($(USE_VENV),1)
install: $(STAMP)
	@echo "deepep_cupy is installed (editable, extras $$(cat $(STAMP))) in $(VENV)"
else
# Offline-safe: the dependencies are already there; setuptools builds the editable install.
install:
	$(PY) -m pip install --no-deps --no-build-isolation $(PIP_FLAGS) -e .
endif

$(VENV_PY): | $(GPU_FIRST)
	$(PYTHON) -m venv $(VENV)

# The stamp holds the extras installed; EXTRAS given explicitly (command line or environment) and
# different from them installs again. The default EXTRAS never does, so that `make test` after
# `make install EXTRAS=cuda13,test` does not add the cuda12 extra.
INSTALLED_EXTRAS := $(strip $(shell cat $(STAMP) 2>/dev/null))
ifneq ($(origin EXTRAS),file)
  ifneq ($(strip $(EXTRAS)),$(INSTALLED_EXTRAS))
    $(STAMP): .extras-changed
  endif
endif
.PHONY: .extras-changed

$(STAMP): $(VENV_PY) pyproject.toml | $(GPU_FIRST)
	$(VENV_PY) -m pip install $(PIP_FLAGS) -e '.[$(EXTRAS)]'
	@echo '$(EXTRAS)' > $@

which:
	@echo "python: $(PY) (USE_VENV=$(USE_VENV))"
	@echo "PYTHONPATH: $(PYTHONPATH)"

clean:
	rm -rf build dist .whl wheelhouse .eggs .pytest_cache .ruff_cache .mypy_cache *.egg-info
	find . \( -path ./$(VENV) -o -path './.venv-*' \) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
