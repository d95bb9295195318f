# Two entry points: `make demo` and `make test`. Both create .venv at the repo root if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
NPROC  := $(shell nproc 2>/dev/null || echo 2)

# TVM's runtime uses one thread unless told otherwise (see shared/TVM_NOTES.md).
export TVM_NUM_THREADS ?= $(NPROC)

.PHONY: demo test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Stamp files: reinstall when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e ".[test]"
	touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/tvm-fusion demo
	$(VENV)/bin/tvm-fusion bench --models tests/corpus --workloads $(DEMO_MODELS) \
		--dim batch=8 --dim seq=64 --repeat 10 --budget 1 --output ''
	$(PY) tutorials/shape_on_host.py --size small
	$(PY) scripts/bench_cnn.py --models squeezenet,resnet50 --no-batch3 --repeat 5 --budget 1 --output ''

# three exported models of the corpus: stock TVM cannot import BERT's loss; the LSTM gates fuse;
# Mixtral's routed experts run without the gathered W[ids] copy (FuseGatheredGates).
# Then the shape idioms: shape-only kernels and copies of their CUDA builds, stock vs ours;
# then a model-zoo CNN (SqueezeNet, from the onnx package) against ONNX Runtime and stock TVM.
DEMO_MODELS := bert_mlm_torchscript,lstm_cell_torchscript,mixtral_torchscript

# One pytest worker per core, whole files per worker; TVM's pool one thread per worker, so the
# workers do not take each other's cores.
test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check tvm_fusion tests scripts tutorials
	TVM_NUM_THREADS=1 $(PY) -m pytest -q -n $(NPROC) --dist loadfile --durations=30

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check tvm_fusion tests scripts tutorials
	$(VENV)/bin/ruff format --check tvm_fusion tests scripts tutorials

bench: $(VENV)/.installed-test
	$(VENV)/bin/tvm-fusion bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
