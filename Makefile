# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
	# Dependencies only; the project itself is a flat set of scripts run from this folder.
	$(BIN)/python -c "import tomllib;print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" > $(VENV)/requirements.txt
	$(BIN)/python -m pip install -q -r $(VENV)/requirements.txt 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch, hydra, wandb, datasets, tokenizers"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python train.py

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) outputs multirun
