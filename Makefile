# Two commands do everything on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo ablation train scaling convergence batch-study test test-fast venv gpu slurm-up slurm-down clean

# The project is a flat set of scripts run from this folder, so only its dependencies are
# installed (pinned in pyproject.toml; torch==2.13.0 is the CPU or CUDA build the host provides),
# and the triton extra: on a CPU host its interpreter is how the tests check kernels.fused=triton
# (a 200 MB wheel, seconds to install; the version torch's CUDA build brings anyway).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['triton']))" > $(VENV)/requirements.txt
	$(BIN)/python -m pip install -q -r $(VENV)/requirements.txt
	$(BIN)/python -c "import torch, hydra, wandb, datasets, tokenizers, transformers"
	touch $(STAMP)

venv: $(STAMP)

# On a CUDA host: the optional `gpu` extra (flash-attn, for kernels.attention=flash and auto). It
# compiles against the venv's torch (no build isolation, so it never pulls another torch), which
# takes a while where no wheel matches.
gpu: $(STAMP)
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu']))" > $(VENV)/gpu-requirements.txt
	$(BIN)/python -m pip install -q packaging ninja
	$(BIN)/python -m pip install --no-build-isolation -r $(VENV)/gpu-requirements.txt

# The main job: MegaScale's Table 3 at CPU scale. The 9 cumulative steps as one Hydra multirun,
# then the table (Markdown here; CSV and LaTeX beside the runs) and the figures. W&B runs offline
# (wandb/ in each job's dir; `wandb sync` uploads). The layout is tp2 pp2 dp2 on 8 ranks
# (conf/study_scale/megascale_ablation_cpu.yaml). Where root allows, on the emulated cluster
# (experiments/emucluster.py): 4 hosts of 2 ranks, TP inside a host over its loopback, PP and DP
# across throttled links ($(DEMO_LINK)), so their communication costs wire time as between GPU
# hosts. Otherwise 8 gloo ranks over this machine's loopback. The table names the fabric, and
# each row the fabric its switch's bytes crossed. Its corpus is built first (once; a job of
# several ranks never builds: `python -m corpus build` with the job's overrides).
# := expands once, so every command sees one dir (no comment after a value: make keeps its spaces)
NOW := $(shell date +%Y-%m-%d_%H-%M-%S)
SWEEP ?= multirun/ablation-$(NOW)
DEMO_LINK ?= 250mbit
ABLATION = train.py -m experiment=megascale_ablation 'ablation.step=range(0,9)' logging.wandb.mode=offline hydra.sweep.dir=$(SWEEP)
demo: $(STAMP)
	$(BIN)/python -m corpus build experiment=megascale_ablation
	if $(BIN)/python experiments/emucluster.py --check; then \
		$(BIN)/python experiments/emucluster.py --hosts 4 --ranks-per-host 2 --bandwidth $(DEMO_LINK) -- $(ABLATION); \
	else \
		$(BIN)/torchrun --standalone --nproc_per_node 8 $(ABLATION); \
	fi
	$(BIN)/python experiments/tables.py $(SWEEP)
	$(BIN)/python experiments/figures.py $(SWEEP)
	@echo "runs and their W&B offline runs (<job>/wandb/): $(SWEEP)/<job>/"
	@echo "table as CSV and LaTeX, figures as PNG and PDF: $(SWEEP)/"

ablation: demo

# One training run of the tiny model on the embedded defaults (a few minutes).
train: $(STAMP)
	$(BIN)/python train.py

# Table 2 at CPU scale: one torchrun per row, since each row has its own world size.
SCALING ?= multirun/scaling-$(NOW)
scaling: $(STAMP)
	$(BIN)/python -m corpus build experiment=strong_scaling
	for row in 0 1 2; do \
		ranks=$$($(BIN)/python -c "import config; c = config.compose(['experiment=strong_scaling', 'scaling.row=$$row']); print(c.scaling.rows[$$row]['gpus'])"); \
		$(BIN)/torchrun --standalone --nproc_per_node $$ranks train.py experiment=strong_scaling scaling.row=$$row \
			logging.progress=false hydra.run.dir=$(SCALING)/$$row || exit 1; \
	done
	$(BIN)/python experiments/tables.py $(SCALING)/0 $(SCALING)/1 $(SCALING)/2 --out $(SCALING)

# Fig. 10 at CPU scale: baseline, PTB+SWA and LAMB at 4x the batch, one process, equal tokens.
CONVERGENCE ?= multirun/convergence-$(NOW)
convergence: $(STAMP)
	$(BIN)/python train.py -m experiment=convergence 'convergence.variant=baseline,ptb_swa,lamb_4x' \
		hydra.sweep.dir=$(CONVERGENCE)
	$(BIN)/python experiments/tables.py $(CONVERGENCE)
	$(BIN)/python experiments/figures.py $(CONVERGENCE)

# Fig. 10's batch study: AdamW and LAMB at k = 1, 2, 3, 4, 8 times the batch at equal tokens, a
# learning-rate sweep per cell, then three seeds at each cell's best rate; its table and figures
# (experiments/batch_study.py; about an hour on 2 cores).
BATCH_STUDY ?= multirun/batch-study-$(NOW)
batch-study: $(STAMP)
	$(BIN)/python experiments/batch_study.py run --out $(BATCH_STUDY)

test: $(STAMP)
	$(BIN)/python -m pytest -n auto

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n auto -m "not slurm"

slurm-up:
	experiments/slurm/local_cluster.sh start

slurm-down:
	experiments/slurm/local_cluster.sh stop

clean:
	rm -rf $(VENV) outputs multirun
