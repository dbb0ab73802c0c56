# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo ablation test test-fast venv slurm-up slurm-down clean

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

# MegaScale's Table 3 at CPU scale: the 9 steps as one multirun on 2 gloo ranks (tp2), then the
# table (Markdown here; CSV and LaTeX beside the runs) and the figures.
NOW := $(shell date +%Y-%m-%d_%H-%M-%S)   # := expands once, so all three commands see one dir
SWEEP ?= multirun/ablation-$(NOW)
ablation: $(STAMP)
	$(BIN)/torchrun --standalone --nproc_per_node 2 train.py -m experiment=megascale_ablation 'ablation.step=range(0,9)' \
		logging.progress=false hydra.sweep.dir=$(SWEEP)
	$(BIN)/python experiments/tables.py $(SWEEP)
	$(BIN)/python experiments/figures.py $(SWEEP)
	@echo "runs, W&B offline runs (wandb/ in each) and the CSV/LaTeX/figures: $(SWEEP)"

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
