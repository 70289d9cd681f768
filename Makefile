# The two commands of the README: `make demo` and `make test`. Both set up .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
FL     := $(BIN)/forgeline
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all up down lint format clean bench-dataprep bench-trainer bench-recovery bench-load bench-shadow bench-hot-start bench-door bench-byo bench-byo-start bench-pipeline bench-soak

# torch first, pinned to the CPU wheel on this machine's disk: resolving `torch` through the
# project's dependencies could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[all,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(FL) up --nodes 2 --gpus-per-node 1
	$(FL) run examples/shakespeare-char.toml

# Two workers (pytest-xdist): most tests wait on processes they started, and one worker kept a
# 2-core machine less than half busy. tests/conftest.py says which tests stay together. The
# slow tests run on one: each drives a whole stack against timeouts, and two stacks side by
# side on 2 cores missed three of them (a swap, a commit, a new gang within 120 s).
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadfile

test: $(STAMP)
	$(BIN)/pytest $(PARALLEL)

test-all: $(STAMP)
	$(BIN)/pytest $(PARALLEL)
	$(BIN)/pytest -m slow

up: $(STAMP)
	$(FL) up --nodes 2 --gpus-per-node 1

down: $(STAMP)
	$(FL) down

# Data preparation beside datatrove and bare encode_batch (about 10 minutes; prints tables).
bench-dataprep: $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.dataprep

# The trainer beside a bare PyTorch loop; checkpoint stall beside dcp.save and torch.save.
bench-trainer: $(STAMP)
	$(BIN)/python -m bench.trainer

bench-recovery: $(STAMP)
	$(BIN)/python -m bench.recovery

# Shadow checks every 50, 200, 1000 steps beside none; how soon they name a corrupt rank.
bench-shadow: $(STAMP)
	$(BIN)/python -m bench.shadow

# A checkpoint's stall and save to commit through a boxed rank's store door, beside direct writes.
bench-door: $(STAMP)
	$(BIN)/python -m bench.door

# A code folder's environment built, reused, or not needed, on the node and through a private
# stack (submit to first step, an image too); a script's own checkpoint folder committed beside
# the SDK's asynchronous save of the same state.
bench-byo: $(STAMP)
	$(BIN)/python -m bench.byo

# A plain script from `forgeline run` to its first step on a private stack: its environment
# built, reused or not needed, and in a container image (about 4 minutes; podman).
bench-byo-start: $(STAMP)
	$(BIN)/python -m bench.byo_start

# A 2-stage pipeline beside 2-replica DDP, its bubble beside theory; activation recomputation's
# memory and step time beside none; the planner's layout for the seed job.
bench-pipeline: $(STAMP)
	$(BIN)/python -m bench.pipeline

bench-hot-start: $(STAMP)
	$(BIN)/python -m bench.hot_start

# Two teams' runs for an hour under a seeded schedule of mixed faults, a fault every 60 s on
# average, then every 20 s (about 2 h 20 min in all): nothing lost or double-booked, recovery by
# fault, goodput measured beside reported and predicted; each soak's record in soak-*.json.
bench-soak: $(STAMP)
	$(BIN)/python -m bench.soak --mean-interval 60 --out soak-60.json
	$(BIN)/python -m bench.soak --mean-interval 20 --out soak-20.json

# 50 small runs at once through one scheduler on a private stack (about 6 minutes).
bench-load: $(STAMP)
	$(BIN)/python -m bench.load

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The local stack's state folder, deleted only once its stack has stopped: a stack still running
# keeps writing into it, and a failed `down` leaves nothing deleted (FORGELINE_HOME is never
# touched: it may be a real deployment's).
clean:
	@if [ -d .forgeline ]; then \
	  FORGELINE_HOME=.forgeline $(FL) down || { \
	    echo "make clean: \`forgeline down\` failed, so nothing was deleted: stop the stack's processes (.forgeline/run/*.pid), then make clean again" >&2; exit 1; }; \
	  echo "make clean: deleting .forgeline/ (the local stack's store, MLflow, Temporal history, tokens and logs)"; \
	  rm -rf .forgeline; \
	fi
