# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast venv slurm-up slurm-down clean

# The project is a flat set of scripts run from this folder, so only its dependencies are
# installed (pinned in pyproject.toml; torch==2.13.0 is the CPU or CUDA build the host provides).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > $(VENV)/requirements.txt
	$(BIN)/python -m pip install -q -r $(VENV)/requirements.txt
	$(BIN)/python -c "import torch, hydra, wandb, datasets, tokenizers, transformers"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python train.py

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slurm"

slurm-up:
	experiments/slurm/local_cluster.sh start

slurm-down:
	experiments/slurm/local_cluster.sh stop

clean:
	rm -rf $(VENV) outputs multirun
