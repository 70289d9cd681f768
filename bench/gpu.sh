#!/usr/bin/env bash
# MFU of the real trainer on the GPUs of this machine: a ~1 B-parameter GPT, bf16 autocast,
# torch.compile, FSDP2 over every local GPU (shard = GPU count), random tokens (no data prep).
#
#   bash bench/gpu.sh            # needs a CUDA build of torch in .venv or on PATH's python
#
# Under 8 minutes on one H200: compile ~1-2 min, then 40 steps. Prints the trainer's own
# tokens/s and MFU (PaLM FLOPs per token against PEAK_FLOPS, default 989e12: H100/H200 dense
# bf16). Writes everything under ${OUT:-/tmp/forgeline-gpu}. Exits non-zero when a rank fails
# (or torchrun runs past RUN_TIMEOUT). STEPS, TOKENS (random tokens to train on) and
# RUN_TIMEOUT shorten it, as bench/gpu_first_contact.sh does. Needs no network: the repository
# goes on PYTHONPATH, nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-/tmp/forgeline-gpu}
PEAK_FLOPS=${PEAK_FLOPS:-989e12}
STEPS=${STEPS:-40}
TOKENS=${TOKENS:-200000000}
RUN_TIMEOUT=${RUN_TIMEOUT:-450}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
GPUS=$("$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.device_count())")

"$PY" - "$OUT" "$GPUS" "$PEAK_FLOPS" "$STEPS" "$TOKENS" <<'EOF'
import json, sys
from pathlib import Path
import numpy as np
from trainer.job import TrainJob
from workflows.contracts.spec import ModelSpec, TrainSpec

out, gpus, peak, steps = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
tokens = int(sys.argv[5])
vocab = 50304
shard = out / f"tokens-{tokens}.bin"
if not shard.exists():
    np.random.default_rng(0).integers(0, vocab, size=tokens, dtype=np.uint32).astype(
        np.uint16).tofile(shard)
# ~1.1 B parameters: 16 layers of width 2048 with SwiGLU and RoPE, 2,048-token context.
model = ModelSpec(n_layer=16, n_head=16, n_embd=2048, block_size=2048, rope=True, swiglu=True)
train = TrainSpec(steps=steps, batch_size=8 * gpus, log_every=10, checkpoint_every=10**6,
                  keep_checkpoints=1, threads_per_rank=8, peak_flops_per_gpu=peak,
                  warmup_steps=5, learning_rate=3e-4, min_lr=3e-5)
job = TrainJob(run_id="gpu-bench", node_id="gpu0", generation=1,
               model={**model.architecture(), "vocab_size": vocab}, train=train.model_dump(),
               train_shards=[str(shard)], dtype="uint16", store_url=str(out / "store"),
               staging_dir=str(out / "staging"), progress_file=str(out / "progress.jsonl"),
               layout={"replicate": 1, "shard": gpus, "tensor": 1})
job.write(out / "job.json")
EOF

rm -f "$OUT/progress.jsonl"
# pipefail: the pipeline's status is torchrun's (a rank's failure, or the timeout's 124).
rc=0
timeout "$RUN_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
  -m trainer.train "$OUT/job.json" 2>&1 | tail -20 || rc=$?
if [ ! -s "$OUT/progress.jsonl" ]; then
  echo "gpu.sh: the ranks reported no progress (torchrun's status $rc)" >&2
  exit $(( rc == 0 ? 1 : rc ))
fi

"$PY" - "$OUT/progress.jsonl" <<'EOF'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1])]
steps = [e for e in events if e["event"] == "step"]
print(f"{'step':>6} {'loss':>8} {'tokens/s':>12} {'MFU':>7}")
for e in steps:
    print(f"{e['step']:>6} {e['loss']:>8.3f} {e['tokens_per_s']:>12,.0f} {e['mfu']:>7.1%}")
steady = [e for e in steps if e["step"] > 10]
if steady:
    best = max(e["mfu"] for e in steady)
    print(f"steady-state MFU (best window after step 10): {best:.1%}  (target >= 45 %)")
EOF
exit "$rc"
