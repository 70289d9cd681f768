#!/usr/bin/env bash
# Forgeline's first contact with a GPU machine (issue 45): about eight minutes on one machine
# of 1 to 8 NVIDIA GPUs, no network needed, from a copy of the working tree.
#
#   bash bench/gpu_first_contact.sh                      # on the GPU machine
#   FIRST_CONTACT_CPU=1 bash bench/gpu_first_contact.sh  # the rehearsal, here, on CPU
#
# Checks, in order (the Python of each is a subcommand of bench/first_contact.py):
#    1 versions            torch, CUDA, driver, NCCL, the GPUs; the torch floor and the torch
#                          APIs the trainer calls (reduce_scatter_single, FSDP's custom
#                          reduce-scatter, DCP's StagingOptions, ...), the trainer's imports
#    2 fork                torchrun --start-method fork: can a forked rank use CUDA, plain and
#                          when torchrun's parent asked for CUDA, without and with
#                          PYTORCH_NVML_BASED_CUDA_CHECK=1 (trainer/device_env.py)
#    3 job                 a 3-step built-in job through trainer/entry.py under torchrun, started
#                          on the warm standby (trainer/warm_launch.py) by trainer.launch.run_ranks,
#                          with the environment trainer/device_env.py gives: commits step 3
#    4 process_group_nccl  trainer.runtime.start's group: an all_reduce on NCCL (and busbw),
#      process_group_gloo  one on gloo (the same group's CPU side, and a gloo group of its own)
#    5 checkpoint          the async Checkpointer saving right after optimizer.step() with no
#                          synchronize, loaded back, compared bit for bit with the weights
#    6 shadow_drift        gradient fingerprints of one micro-batch: eager vs eager, backward vs
#                          recompute, compiled vs eager (and GPU 0 vs GPU 1): the largest relative
#                          difference, and the shadow_rtol it suggests for CUDA
#    7 ddp_compile_shadow  DDP + torch.compile + recovery.shadow_every = 1 over two steps: both
#                          checks agree, no "Expected to have finished reduction" (with one GPU:
#                          two CPU ranks, since DDP needs two ranks)
#    8 fsdp_grad_watch     FSDP2 (shard = GPU count), the gradient watch off and on: host syncs
#                          per step (torch.cuda.set_sync_debug_mode) and step time
#   8b pipeline            the built-in GPT as a 2-stage 1F1B pipeline on two GPUs (skipped with
#                          one): three steps, the first loss against the whole model's
#    9 evaluate_sample     the job's checkpoint through trainer/evaluate.py; held-out loss and
#                          trainer/sampling.py with the model on the device; trainer/serving.py
#   10 gpu_sh              bench/gpu.sh: tokens/s and MFU of a ~1 B GPT under FSDP + compile
#
# Each check appends one JSON line per result ({check, ok, skipped, figures, error, seconds})
# to $OUT/first_contact.jsonl and prints it; its own output goes to $OUT/logs/CHECK.log. A
# failing check (a rank that fails included) does not stop the later ones; the script exits
# 1 at the end if any failed, after the summary table. Each step has its own timeout; on the
# GPU machine they add up to 575 s. Large files go under $WORK (/tmp/forgeline-first-contact),
# results under $OUT (default $WORK/out).
#
# The rehearsal (FIRST_CONTACT_CPU=1) hides any GPU and runs every check on CPU with two gloo
# ranks and a tiny GPT; what needs CUDA is recorded as "skipped: needs CUDA". Without it and
# without CUDA the script stops at once. tests/test_gpu_first_contact.py runs the rehearsal.
#
# Environment: PYTHON (default .venv/bin/python, else python3; never pip install: the machine
# has no network), OUT, WORK, STEPS_GPU_SH (bench/gpu.sh's steps, default 15).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
WORK=${WORK:-/tmp/forgeline-first-contact}
OUT=${OUT:-$WORK/out}
CPU=${FIRST_CONTACT_CPU:-0}
export OUT FIRST_CONTACT_WORK="$WORK" FIRST_CONTACT_CPU="$CPU"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FC="-m bench.first_contact"

if [ "$CPU" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the rehearsal is the same on any machine
elif ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)'; then
  echo "gpu_first_contact: no CUDA device visible to $PY (torch missing, a CPU build, or no" \
       "GPU). Run it on the GPU machine, or FIRST_CONTACT_CPU=1 for the CPU rehearsal." >&2
  exit 2
fi

mkdir -p "$WORK" "$OUT/logs"
rm -f "$OUT/first_contact.jsonl"
started=$SECONDS
echo "first contact: $( [ "$CPU" = 1 ] && echo "CPU rehearsal" || echo GPU ), python $PY," \
     "results in $OUT/first_contact.jsonl"

# step NAME GPU_SECONDS CPU_SECONDS: one check under its own timeout; its result is settled
# (recorded as a failure if the check died without one) before the next starts.
step() {
  local name=$1 budget=$2
  [ "$CPU" = 1 ] && budget=$3
  local log="$OUT/logs/$name.log"
  timeout -k 5 "$budget" "$PY" $FC "$name" --budget "$budget" >"$log" 2>&1
  local rc=$?
  grep '^\[first-contact\]' "$log"
  "$PY" $FC settle "$name" --rc "$rc" --log "$log"
}

step versions            15  60
step fork                40  60
step job                 90  90
step process_groups      30  60
step checkpoint          40  60
step shadow_drift        45  120
step ddp_compile_shadow  70  150
step fsdp_grad_watch     35  60
step pipeline            35  60
step evaluate_sample     25  60

# 10: bench/gpu.sh under its own timeout; its torchrun's failure is its exit status.
gpu_rc=0
if [ "$CPU" != 1 ]; then
  OUT="$WORK/gpu" STEPS=${STEPS_GPU_SH:-15} TOKENS=20000000 RUN_TIMEOUT=130 PYTHON="$PY" \
    timeout -k 5 150 bash bench/gpu.sh >"$OUT/logs/gpu_sh.log" 2>&1
  gpu_rc=$?
  tail -n 5 "$OUT/logs/gpu_sh.log"
fi
"$PY" $FC gpu_sh --rc "$gpu_rc" --dir "$WORK/gpu" >>"$OUT/logs/gpu_sh.log" 2>&1
grep '^\[first-contact\] gpu_sh' "$OUT/logs/gpu_sh.log"
"$PY" $FC settle gpu_sh --rc "$gpu_rc" --log "$OUT/logs/gpu_sh.log"

"$PY" $FC summary
status=$?
echo "first contact took $((SECONDS - started)) s"
exit "$status"
