"""The checks of bench/gpu_first_contact.sh, one subcommand each (read that script first).

    python -m bench.first_contact CHECK [--budget S]    # one check: appends its result(s)
    python -m bench.first_contact settle CHECK --rc RC  # after a check: a line for each it owes
    python -m bench.first_contact summary               # the table; exit 1 if any check failed

Each check appends one JSON line per result to $OUT/first_contact.jsonl ({check, ok, skipped,
figures, error, seconds}) and prints it as a line for people. Checks that need several ranks
start torchrun the way Forgeline does (`--start-method fork --run-path`, this file as the rank
script: `rank NAME WORKDIR`), each rank writing its figures to WORKDIR/rank-R.json.

FIRST_CONTACT_CPU=1 is the rehearsal: two gloo ranks on CPU, tiny models, and every part that
needs CUDA recorded as "skipped: needs CUDA". Only the standard library is imported at the top:
`settle` and `summary` run without torch, and a forked rank gets torch from torchrun.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == THIS.parent:
    # Run as a file, bench/ would come first on the path, and bench/dataprep.py would hide the
    # `dataprep` package from every module the checks import: the repository comes first.
    sys.path[0] = str(REPO)
NEEDS_CUDA = "needs CUDA"
RESULTS = "first_contact.jsonl"
# The words of the DDP reducer's error that finding 3 of issue 45 was about (a shadow recompute
# through DDP's forward under torch.compile).
REDUCER_ERROR = "Expected to have finished reduction"
JOB_RUN = "fc-job"  # the run of the `job` check; `evaluate_sample` reads its checkpoint
# What each check records: most one line under their own name, the process groups two.
RECORDS: dict[str, tuple[str, ...]] = {
    "versions": ("versions",),
    "fork": ("fork",),
    "job": ("job",),
    "process_groups": ("process_group_nccl", "process_group_gloo"),
    "checkpoint": ("checkpoint",),
    "shadow_drift": ("shadow_drift",),
    "ddp_compile_shadow": ("ddp_compile_shadow",),
    "fsdp_grad_watch": ("fsdp_grad_watch",),
    "pipeline": ("pipeline",),
    "evaluate_sample": ("evaluate_sample",),
    "gpu_sh": ("gpu_sh",),
}


# ---- context and records -------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A model of the check: the built-in GPT's fields (trainer.model.GPTConfig) and a batch."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch: int  # sequences per rank

    def config(self) -> dict[str, Any]:
        from workflows.contracts.spec import ModelSpec

        # Through the spec, so the network has what a run's would (fused qkv, no biases).
        spec = ModelSpec(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         block_size=self.block_size)  # fmt: skip
        return {**spec.architecture(), "vocab_size": self.vocab_size}


# The rehearsal's one shape for every check: the same graphs, so torch.compile's cache that
# `shadow_drift` fills serves `ddp_compile_shadow` (compiling costs ~40 s on 2 cores).
TINY = Shape(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512, batch=4)
# On a GPU: a job that compiles in seconds, and a model whose optimizer step and checkpoint
# copy last long enough (about 150 M parameters) for a missing synchronization to show.
SMALL_GPU = Shape(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=50304, batch=8)
MEDIUM_GPU = Shape(n_layer=8, n_head=16, n_embd=1024, block_size=512, vocab_size=50304, batch=8)


@dataclass(frozen=True)
class Context:
    out: Path  # results only
    work: Path  # everything large: data, stores, checkpoints, compile caches
    cpu: bool  # the rehearsal

    @classmethod
    def from_env(cls) -> Context:
        work = Path(os.environ.get("FIRST_CONTACT_WORK", "/tmp/forgeline-first-contact"))
        out = Path(os.environ.get("OUT", work / "out"))
        return cls(out=out, work=work, cpu=os.environ.get("FIRST_CONTACT_CPU") == "1")

    @property
    def small(self) -> Shape:
        return TINY if self.cpu else SMALL_GPU

    @property
    def medium(self) -> Shape:
        return TINY if self.cpu else MEDIUM_GPU

    @property
    def compile_cache(self) -> Path:
        return self.work / "compile-cache"

    def world(self) -> int:
        """Ranks for the multi-rank checks: one a GPU; two gloo ranks in the rehearsal."""
        if self.cpu:
            return 2
        import torch

        return torch.cuda.device_count()


@dataclass
class Result:
    check: str
    ok: bool
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None  # why it did not run (ok stays True: nothing failed)
    seconds: float = 0.0


def skipped(check: str, why: str = NEEDS_CUDA, **figures: Any) -> Result:
    return Result(check, ok=True, figures=figures, skipped=why)


def record(ctx: Context, result: Result) -> None:
    """Append the result to the results file and say it on stdout."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    with open(ctx.out / RESULTS, "a") as handle:
        handle.write(json.dumps(asdict(result), default=str) + "\n")
    print(human_line(asdict(result)), flush=True)


def human_line(result: dict[str, Any]) -> str:
    status = "SKIP" if result.get("skipped") else "PASS" if result["ok"] else "FAIL"
    shown = ", ".join(f"{k}={_short(v)}" for k, v in list(result["figures"].items())[:8])
    why = result.get("skipped") or result.get("error") or ""
    why = (why.strip().splitlines() or [""])[-1][:200]
    return f"[first-contact] {result['check']:<20} {status} {result['seconds']:6.1f} s  {shown}" + (
        f"  -- {why}" if why else ""
    )


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def read_results(ctx: Context) -> list[dict[str, Any]]:
    path = ctx.out / RESULTS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def error_text(err: BaseException) -> str:
    return "".join(traceback.format_exception(err))[-3000:]


# ---- processes ------------------------------------------------------------------------------


class Stopped(Exception):
    """The step's timeout sent SIGTERM: recorded as this check's failure before exiting."""


def _stop_on_sigterm() -> None:
    # The shell's `timeout` sends SIGTERM: raise so `finally` kills torchrun's process group
    # and the check records why it stopped.
    def stop(signum: int, frame: object) -> None:
        raise Stopped("stopped by the step's timeout (SIGTERM)")

    signal.signal(signal.SIGTERM, stop)


def run_group(
    argv: list[str], env: dict[str, str], log: Path, timeout_s: float, cwd: Path = REPO
) -> int:
    """Run `argv` in a session of its own, output to `log`; kill the whole session (torchrun and
    its ranks) on a timeout or on the way out. 124 on a timeout, as `timeout` says it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return 124
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def rank_env(ctx: Context, workdir: Path) -> dict[str, str]:
    """A job's environment as a node agent gives it (trainer.device_env), and OMP as run_ranks."""
    from trainer.device_env import device_environment

    return {
        **os.environ,
        "OMP_NUM_THREADS": "1" if ctx.cpu else "4",
        "PYTHONUNBUFFERED": "1",
        **device_environment(os.environ, workdir, ctx.compile_cache),
    }


def torchrun_args(nproc: int, *script: str) -> list[str]:
    """Forgeline's way of starting ranks (trainer.launch.torchrun_args): forked from torchrun,
    this file run in them."""
    return ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--start-method", "fork", "--run-path", str(THIS), *script]  # fmt: skip


def launch_ranks(
    ctx: Context, name: str, nproc: int, workdir: Path, timeout_s: float,
    env: dict[str, str] | None = None, parent: list[str] | None = None,
) -> tuple[int, list[dict[str, Any]], Path]:  # fmt: skip
    """torchrun with `nproc` ranks running `rank NAME WORKDIR`; its status, each rank's report
    (in rank order; {} for a rank that wrote none) and its log. `parent` replaces the plain
    `python -m torch.distributed.run` (the fork check's probing parent)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("rank-*.json"):
        old.unlink()
    head = parent or [sys.executable, "-m", "torch.distributed.run"]
    argv = [*head, *torchrun_args(nproc, "rank", name, str(workdir))]
    log = workdir / "torchrun.log"
    rc = run_group(argv, env or rank_env(ctx, workdir), log, timeout_s)
    reports = []
    for rank in range(nproc):
        path = workdir / f"rank-{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return rc, reports, log


def rank_report(workdir: Path, data: dict[str, Any]) -> None:
    rank = int(os.environ.get("RANK", "0"))
    (workdir / f"rank-{rank}.json").write_text(json.dumps(data, default=str))


@contextlib.contextmanager
def reporting_rank(workdir: Path) -> Iterator[dict[str, Any]]:
    """A rank's figures, written whatever happens; an exception is written and raised again,
    so torchrun (and the check) fail as a rank of a real job would."""
    data: dict[str, Any] = {}
    try:
        yield data
    except BaseException as err:
        data["error"] = error_text(err)
        raise
    finally:
        rank_report(workdir, data)


def rank_errors(reports: list[dict[str, Any]], rc: int, log: Path) -> str | None:
    """Why a multi-rank check failed, or None: a rank's own error, or torchrun's status."""
    for rank, report in enumerate(reports):
        if "error" in report:
            return f"rank {rank}: {report['error']}"
        if not report:
            return f"rank {rank} wrote no report (torchrun status {rc}); log:\n{tail(log)}"
    if rc != 0:
        return f"torchrun exited with status {rc}; log:\n{tail(log)}"
    return None


# ---- data -----------------------------------------------------------------------------------


def token_files(ctx: Context, shape: Shape) -> tuple[Path, Path]:
    """Random training and validation tokens for `shape`'s vocabulary (written once)."""
    import numpy as np

    folder = ctx.work / "data" / f"v{shape.vocab_size}"
    folder.mkdir(parents=True, exist_ok=True)
    train, val = folder / "train.bin", folder / "val.bin"
    sizes = (200_000, 50_000) if ctx.cpu else (4_000_000, 500_000)
    for path, size, seed in ((train, sizes[0], 0), (val, sizes[1], 1)):
        if not path.exists():
            tokens = np.random.default_rng(seed).integers(0, shape.vocab_size, size=size)
            tokens.astype(np.uint16).tofile(path)
    return train, val


def random_batch(shape: Shape, device: Any, seed: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.block_size)
    x = torch.randint(0, shape.vocab_size, size, generator=generator)
    y = torch.randint(0, shape.vocab_size, size, generator=generator)
    return x.to(device), y.to(device)


# ---- 1. versions ----------------------------------------------------------------------------


def torch_floor() -> str:
    """The torch release the project requires at least (pyproject.toml's `torch>=`)."""
    found = re.search(r'"torch>=([0-9.]+)', (REPO / "pyproject.toml").read_text())
    return found.group(1) if found else "2.13"


def _has(path: str) -> bool:
    """Whether `module.attr[.attr...]` exists: the longest importable module, then attributes."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


# The torch APIs Forgeline calls that are recent or private (grep trainer/ for them): FSDP's
# custom reduce-scatter with reduce_scatter_single (trainer/shard_watch.py), DCP's staging on
# CUDA (trainer/checkpoint.py), the state-dict helpers, DDP's hooks (trainer/grad_watch.py).
TORCH_APIS = (
    "torch.distributed.reduce_scatter_single",
    "torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter",
    "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
    "torch.distributed.fsdp._fully_shard._fsdp_collectives.DefaultAllocMixin",
    "torch.distributed.checkpoint.staging.StagingOptions",
    "torch.distributed.checkpoint.staging.DefaultStager",
    "torch.distributed.checkpoint.state_dict.get_state_dict",
    "torch.distributed.checkpoint.async_save",
    "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook",
    "torch.cuda.set_sync_debug_mode",
)
# The product's modules that import those at their top: an import error there is a rank's.
PRODUCT_MODULES = ("trainer.shard_watch", "trainer.checkpoint", "trainer.grad_watch",
                   "forgeline.training", "trainer.train")  # fmt: skip


def driver_version() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout else None


def _nccl_version() -> str:
    version = __import__("torch").cuda.nccl.version()  # a tuple; an int in older releases
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def check_versions(ctx: Context, budget_s: float) -> list[Result]:
    import importlib

    import torch
    import torch.distributed as dist
    from torch.torch_version import TorchVersion

    cuda = torch.cuda.is_available()
    figures: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "driver": driver_version(),
        "nccl": _nccl_version() if cuda else None,
        "python": sys.version.split()[0],
        "floor": torch_floor(),
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
    }
    problems = []
    if TorchVersion(torch.__version__) < torch_floor():
        problems.append(f"torch {torch.__version__} is below the floor {torch_floor()}")
    missing = [api for api in TORCH_APIS if not _has(api)]
    problems += [f"missing {api}" for api in missing]
    for module in PRODUCT_MODULES:
        try:
            importlib.import_module(module)
        except Exception as err:
            problems.append(f"import {module}: {type(err).__name__}: {err}")
    if not ctx.cpu:
        if not cuda:
            problems.append("no CUDA device")
        if not dist.is_nccl_available():
            problems.append("this torch has no NCCL")
    figures["apis_missing"] = missing
    return [Result("versions", ok=not problems, figures=figures, error="; ".join(problems) or None)]


# ---- 2. fork --------------------------------------------------------------------------------


def rank_fork_child(workdir: Path) -> None:
    """A forked rank: can it use CUDA, and did it inherit a CUDA its parent had initialized?"""
    import torch

    data: dict[str, Any] = {"pid": os.getpid()}
    bad_fork = getattr(torch.cuda, "_is_in_bad_fork", lambda: None)
    data["bad_fork"] = bad_fork()
    try:
        data["cuda_available"] = torch.cuda.is_available()
        if data["cuda_available"]:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            data["cuda_value"] = float((torch.ones(1, device=f"cuda:{local}") + 1).item())
        data["cuda_ok"] = data["cuda_available"] and data.get("cuda_value") == 2.0
    except Exception as err:  # the finding itself: recorded, not raised
        data["cuda_ok"], data["error_text"] = False, f"{type(err).__name__}: {err}"
    rank_report(workdir, data)


def fork_parent(args: list[str]) -> None:
    """torchrun after the parent asked `torch.cuda.is_available()`, as a launcher that checks
    for GPUs before it forks ranks does (what trainer/device_env.py's NVML setting is for)."""
    import torch

    available = torch.cuda.is_available()
    print(f"parent: cuda available {available}, initialized {torch.cuda.is_initialized()}")
    from torch.distributed import run as torchrun

    torchrun.main(args)


def check_fork(ctx: Context, budget_s: float) -> list[Result]:
    """Three forks: plain torchrun; torchrun whose parent asked for CUDA, without and with
    PYTORCH_NVML_BASED_CUDA_CHECK=1 (the expectation: without it, "Cannot re-initialize CUDA
    in forked subprocess"; with it, the rank uses CUDA)."""
    variants = {
        "plain_torchrun": (False, False),
        "parent_probes_without_nvml": (True, False),
        "parent_probes_with_nvml": (True, True),
    }
    figures: dict[str, Any] = {}
    for name, (probes, nvml) in variants.items():
        workdir = ctx.work / "fork" / name
        env = rank_env(ctx, workdir)
        env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        if nvml:
            env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        probing = [sys.executable, "-m", "bench.first_contact", "fork-parent", "--"]
        parent = probing if probes else None
        rc, reports, log = launch_ranks(ctx, "fork_child", 1, workdir, budget_s / 3.5, env, parent)
        child = reports[0]
        figures[name] = {"rc": rc, **{k: child.get(k) for k in ("cuda_ok", "bad_fork")}}
        if "error_text" in child:
            figures[name]["error"] = child["error_text"][:200]
        if not child:
            figures[name]["error"] = f"no report; log: {tail(log, 400)}"
    reported = all("cuda_ok" in v for v in figures.values())
    if ctx.cpu:
        figures["note"] = "rehearsal: the forks ran; CUDA in them needs CUDA"
        return [Result("fork", ok=reported, figures=figures,
                       error=None if reported else "a forked rank wrote no report")]  # fmt: skip
    without = figures["parent_probes_without_nvml"]
    figures["expectation_met"] = bool(
        figures["parent_probes_with_nvml"].get("cuda_ok")
        and not without.get("cuda_ok")
        and "re-initialize CUDA" in str(without.get("error", ""))
    )
    ok = bool(figures["parent_probes_with_nvml"].get("cuda_ok")) and bool(
        figures["plain_torchrun"].get("cuda_ok")
    )
    error = None if ok else "a forked rank could not use CUDA with Forgeline's environment"
    return [Result("fork", ok=ok, figures=figures, error=error)]


# ---- 3. a job through the rank entry, on the warm standby -----------------------------------


def make_job(ctx: Context, run_id: str, world: int, steps: int, **train: Any) -> Any:
    """A TrainJob as a node agent writes it (tests/trainer/conftest.py's, bench/gpu.sh's)."""
    from trainer.job import TrainJob
    from workflows.contracts.spec import RecoverySpec, TrainSpec

    shape = ctx.small
    train_file, val_file = token_files(ctx, shape)
    folder = ctx.work / run_id
    spec = TrainSpec(
        steps=steps, batch_size=shape.batch * world, log_every=1, checkpoint_every=steps,
        keep_checkpoints=1, warmup_steps=1, threads_per_rank=1 if ctx.cpu else 4,
        peak_flops_per_gpu=None if ctx.cpu else 989e12, **train,
    )  # fmt: skip
    return TrainJob(
        run_id=run_id, node_id="n0", generation=1, model=shape.config(),
        train=spec.model_dump(), train_shards=[str(train_file)], val_shards=[str(val_file)],
        dtype="uint16", store_url=str(folder / "store"), staging_dir=str(folder / "staging"),
        progress_file=str(folder / "gen-1" / "progress.jsonl"),
        spikes=RecoverySpec().spike_settings(),
    )  # fmt: skip


async def _run_job(
    ctx: Context, job: Any, world: int, timeout_s: float, warm: bool
) -> tuple[Any, list[str]]:
    """The job's ranks under torchrun as the node agent starts them (trainer.launch.run_ranks),
    on a warm standby (trainer.warm_launch) when `warm`; its tail and the launcher's words."""
    import logging

    from infra.processes import free_port
    from trainer.launch import Rendezvous, run_ranks
    from trainer.warm_launch import WarmLauncher

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, entry: logging.LogRecord) -> None:
            said.append(entry.getMessage())

    logger = logging.getLogger("trainer.warm_launch")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    workdir = Path(job.progress_file).parent
    rdzv = Rendezvous(f"127.0.0.1:{free_port()}", f"{job.run_id}-1", 1, world)
    launcher = WarmLauncher(ctx.work / "standby") if warm else None
    try:
        if launcher is not None:
            await launcher.prepare()
        launch = run_ranks(job, workdir, rdzv, on_progress=lambda _: None, launcher=launcher,
                           compile_cache=ctx.compile_cache,
                           threads_per_rank=1 if ctx.cpu else 4)  # fmt: skip
        return await asyncio.wait_for(launch, timeout_s), said
    finally:
        if launcher is not None:
            await launcher.close()


def progress_events(job: Any) -> list[dict[str, Any]]:
    path = Path(job.progress_file)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def check_job(ctx: Context, budget_s: float) -> list[Result]:
    import shutil

    from infra.store.local import LocalStore
    from trainer.manifest import committed_steps

    shutil.rmtree(ctx.work / JOB_RUN, ignore_errors=True)
    world = ctx.world()
    job = make_job(ctx, JOB_RUN, world, steps=3)
    started = time.monotonic()
    tail_, said = asyncio.run(_run_job(ctx, job, world, budget_s - 10, warm=True))
    latest = tail_.latest
    committed = committed_steps(LocalStore(Path(job.store_url)), JOB_RUN)
    figures = {
        "ranks": world,
        "steps": latest.get("step"),
        "loss": latest.get("loss"),
        "tokens_per_s": latest.get("tokens_per_s"),
        "committed": committed,
        "warm_standby": any("warm standby" in s for s in said),
        "wall_s": round(time.monotonic() - started, 1),
        "device_env": sorted(rank_env(ctx, Path(job.progress_file).parent).keys()
                             & {"PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_DEVICE_ORDER",
                                "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCHINDUCTOR_CACHE_DIR"}),
    }  # fmt: skip
    ok = tail_.finished and latest.get("step") == 3 and 3 in committed
    error = None if ok else f"the job did not finish 3 steps with a commit: {latest}"
    if ok and not figures["warm_standby"]:
        ok, error = False, "the job started cold: the warm standby was not used"
    return [Result("job", ok=ok, figures=figures, error=error)]


# ---- 4. process groups ----------------------------------------------------------------------


def rank_process_groups(workdir: Path) -> None:
    """The runtime's process group (trainer.runtime.start: NCCL for CUDA tensors, gloo for CPU
    ones) and a gloo group of its own, as the Checkpointer makes: one all_reduce on each."""
    import torch
    import torch.distributed as dist

    from trainer import runtime

    with reporting_rank(workdir) as data:
        rt = runtime.start(0, 60)
        world, want = rt.world, rt.world * (rt.world + 1) / 2
        data["backend"] = str(dist.get_backend())
        cpu = torch.tensor([float(rt.rank + 1)])
        dist.all_reduce(cpu)
        data["gloo_default_group"] = float(cpu.item()) == want
        group = dist.new_group(backend="gloo")
        own = torch.tensor([float(rt.rank + 1)])
        dist.all_reduce(own, group=group)
        data["gloo_own_group"] = float(own.item()) == want
        if rt.is_cuda:
            value = torch.tensor([float(rt.rank + 1)], device=rt.device)
            dist.all_reduce(value)
            data["nccl"] = float(value.item()) == want
            data["nccl_busbw_gb_s"] = _bus_bandwidth(rt.device, world)
        dist.destroy_process_group()


def _bus_bandwidth(device: Any, world: int) -> float | None:
    """NCCL all_reduce bus bandwidth on 256 MiB (nccl-tests' busbw); None on one rank."""
    import torch
    import torch.distributed as dist

    if world < 2:
        return None
    buffer = torch.ones(64 << 20, device=device)
    dist.all_reduce(buffer)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(buffer)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / 5
    return round(2 * (world - 1) / world * buffer.numel() * 4 / seconds / 1e9, 1)


def check_process_groups(ctx: Context, budget_s: float) -> list[Result]:
    world = ctx.world()
    rc, reports, log = launch_ranks(ctx, "process_groups", world, ctx.work / "pg", budget_s - 5)
    error = rank_errors(reports, rc, log)
    first = reports[0] if reports else {}
    gloo_ok = error is None and all(r.get("gloo_default_group") and r.get("gloo_own_group")
                                    for r in reports)  # fmt: skip
    gloo = Result("process_group_gloo", ok=gloo_ok, error=error,
                  figures={"ranks": world, "backend": first.get("backend")})  # fmt: skip
    if ctx.cpu:
        return [skipped("process_group_nccl"), gloo]
    nccl_ok = error is None and all(r.get("nccl") for r in reports)
    nccl = Result("process_group_nccl", ok=nccl_ok, error=error, figures={
        "ranks": world, "backend": first.get("backend"),
        "busbw_gb_s": first.get("nccl_busbw_gb_s"),
    })  # fmt: skip
    return [nccl, gloo]


# ---- 5. a checkpoint taken right after optimizer.step() -------------------------------------


def rank_checkpoint(workdir: Path) -> None:
    """Three steps, each saved (Forgeline's asynchronous Checkpointer) the moment its optimizer
    step is queued, with no synchronize; each save fetched back and loaded into a fresh model,
    compared bit for bit with the weights that step left. A stager that copies before the
    optimizer's kernels finish, or after the next step's, saves other weights than these."""
    import torch

    from infra.store.local import LocalStore
    from trainer import runtime
    from trainer.checkpoint import Checkpointer, fetch_checkpoint, load_model_weights
    from trainer.manifest import read_manifest
    from trainer.model import GPT, GPTConfig
    from trainer.parallel import Layout, build_mesh, parallelize

    ctx = Context.from_env()
    with reporting_rank(workdir) as data:
        rt = runtime.start(0, 120)
        shape, layout = ctx.medium, Layout(replicate=rt.world)
        config = GPTConfig(**shape.config())
        torch.manual_seed(0)
        model = GPT(config).to(rt.device)
        wrapped = parallelize(model, layout, build_mesh(layout, rt.device.type))
        optimizer = model.optimizer(1e-3, 0.1)
        store = LocalStore(workdir / "store")
        saver = Checkpointer(store=store, staging_dir=workdir / "staging", run_id="fc-ckpt",
                             generation=1, keep=5, layout=layout.to_dict())  # fmt: skip
        # As the SDK does: the staged copy must be complete before the weights change.
        optimizer.register_step_pre_hook(lambda *_: saver.before_weights_change())
        data["stager"] = type(saver._stager).__name__
        x, y = random_batch(shape, rt.device, seed=rt.rank)
        snapshots, reports = {}, []
        for step in (1, 2, 3):
            with rt.autocast():
                _, loss = wrapped(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            previous = saver.save(wrapped, optimizer, step, {"model_config": config.to_dict()})
            reports += [previous] if previous else []
            # Queued after the optimizer's kernels, before the next step's: what step left.
            snapshots[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        reports.append(saver.wait())
        saver.close()
        data["stall_s"] = [round(r.stall_s, 4) for r in reports]
        mismatched: dict[int, list[str]] = {}
        for report in reports:
            assert report.manifest_key is not None, f"step {report.step} was not committed"
            folder = fetch_checkpoint(store, read_manifest(store, report.manifest_key),
                                      workdir / f"verify-{rt.rank}-{report.step}")  # fmt: skip
            fresh = GPT(config)
            load_model_weights(fresh, folder)  # collective: every rank loads its copy
            loaded = fresh.state_dict()
            want = snapshots[report.step]
            mismatched[report.step] = [k for k in want if not torch.equal(want[k].cpu(), loaded[k])]
        data["mismatched"] = {step: names[:5] for step, names in mismatched.items() if names}
        data["weights_moved"] = not all(
            torch.equal(snapshots[1][k], snapshots[2][k]) for k in snapshots[1]
        )
        data["saved_steps"] = sorted(mismatched)


def check_checkpoint(ctx: Context, budget_s: float) -> list[Result]:
    import shutil

    shutil.rmtree(ctx.work / "ckpt", ignore_errors=True)
    world = ctx.world()
    rc, reports, log = launch_ranks(ctx, "checkpoint", world, ctx.work / "ckpt", budget_s - 5)
    error = rank_errors(reports, rc, log)
    first = reports[0] if reports else {}
    figures = {k: first.get(k) for k in ("stager", "saved_steps", "weights_moved", "stall_s")}
    figures["mismatched"] = {r: rep.get("mismatched") for r, rep in enumerate(reports)
                             if rep.get("mismatched")}  # fmt: skip
    if error is None and figures["mismatched"]:
        error = f"the checkpoint differs from the weights it was taken of: {figures['mismatched']}"
    if error is None and first.get("saved_steps") != [1, 2, 3]:
        error = f"saved steps {first.get('saved_steps')}, not [1, 2, 3]"
    if error is None and not first.get("weights_moved"):
        error = "the weights did not change between steps: the comparison proves nothing"
    return [Result("checkpoint", ok=error is None, figures=figures, error=error)]


# ---- 6. drift of gradient fingerprints ------------------------------------------------------


def _use_compile_cache(ctx: Context) -> None:
    """The compile caches a job of this machine uses (trainer.device_env), so checks share."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ctx.compile_cache / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(ctx.compile_cache / "triton"))


def suggested_rtol(drift: float) -> float:
    """A tolerance ten times the largest drift seen, rounded up to a power of ten (0: bitwise)."""
    if drift == 0:
        return 0.0
    return 10.0 ** math.ceil(math.log10(drift * 10))


def check_shadow_drift(ctx: Context, budget_s: float) -> list[Result]:
    """How far two computations of one micro-batch's gradients drift apart on this device:
    the fingerprints (trainer.shadow_check) of eager against eager, of the loop's backward
    against the check's recompute, of compiled (the built-in trainer compiles on CUDA: the
    owner's side) against eager (the checker recomputes the plain module), and of another GPU."""
    import torch

    from trainer.model import GPT, GPTConfig
    from trainer.shadow_check import drift, fingerprint, gradient_summary, recompute

    _use_compile_cache(ctx)
    device = torch.device("cpu" if ctx.cpu else "cuda:0")
    # The job's shape: its compiled graphs are in the cache already, so compiling here costs
    # seconds, not the minute a larger model's first compile takes.
    shape = ctx.small
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape.config())).to(device)
    x, y = random_batch(shape, device, seed=0)

    def autocast() -> contextlib.AbstractContextManager:
        # As a rank's forward runs (trainer.runtime.Runtime.autocast).
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def checked(module: torch.nn.Module, inputs: Any = (x, y)) -> tuple[float, float]:
        def loss() -> torch.Tensor:
            with autocast():
                return module(*inputs)[1]

        return recompute(module, loss)

    def backward(module: torch.nn.Module) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        with autocast():
            module(x, y)[1].backward()
        return fingerprint(gradient_summary(p.grad) for p in model.parameters() if p.requires_grad)

    eager = checked(model)
    figures: dict[str, Any] = {
        "device": str(device),
        "eager_vs_eager": drift(eager, checked(model)),
        "backward_vs_recompute": drift(eager, backward(model)),
    }
    compiled = torch.compile(model)
    figures["compiled_vs_eager"] = drift(eager, checked(compiled))
    figures["compiled_backward_vs_eager"] = drift(eager, backward(compiled))
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        import copy

        other = copy.deepcopy(model).to("cuda:1")
        figures["gpu0_vs_gpu1"] = drift(eager, checked(other, (x.to("cuda:1"), y.to("cuda:1"))))
    drift = max(v for v in figures.values() if isinstance(v, float))
    figures["largest"] = drift
    figures["suggested_rtol"] = suggested_rtol(drift)
    # The spec allows shadow_rtol up to 0.1: a drift past it leaves no tolerance that works.
    ok = suggested_rtol(drift) <= 0.1
    error = None if ok else f"fingerprints drift by {drift:.3g}: no shadow_rtol ≤ 0.1 holds"
    return [Result("shadow_drift", ok=ok, figures=figures, error=error)]


# ---- 7. DDP + torch.compile + shadow checks -------------------------------------------------


def compiled_rank_script() -> None:
    """The built-in trainer (trainer/train.py) with torch.compile on any device: on CPU the
    built-in one compiles nothing, and this check is about a compiled DDP model under shadow
    checks. Run as the job's entrypoint (`bench.first_contact:compiled_rank_script`)."""
    import torch

    import forgeline
    from trainer.model import GPT, GPTConfig
    from trainer.parallel import parallelize

    run = forgeline.init()
    cfg = run.settings
    config = GPTConfig(**run.model_shape)
    torch.manual_seed(cfg.seed)
    model = GPT(config).to(run.device)
    wrapped = parallelize(model, run.layout, run.placement)
    optimizer = model.optimizer(cfg.learning_rate, cfg.weight_decay)
    run.restore(wrapped, optimizer, model_config=config.to_dict())
    wrapped = torch.compile(wrapped)
    run.dataset(config.block_size)
    micro = cfg.grad_accum_steps
    run.recompute_with(lambda module, x, y: module(x, y)[1] / micro)
    for step in run.steps():
        loss_sum = torch.zeros((), device=run.device)
        for x, y in step.micro_batches():
            with step.forward():
                _, loss = wrapped(x, y)
            (loss / micro).backward()
            loss_sum += loss.detach() / micro
        step.gradients(wrapped, max_norm=cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.report(loss_sum)
    run.finish()


def check_ddp_compile_shadow(ctx: Context, budget_s: float) -> list[Result]:
    """Two steps of DDP over every GPU under torch.compile with a shadow check on each
    (`recovery.shadow_every = 1`); with one GPU (or in the rehearsal) two CPU ranks run the
    built-in trainer's loop compiled (compiled_rank_script), since DDP needs two ranks and
    NCCL one GPU a rank."""
    import shutil

    import torch

    from workflows.contracts.spec import RecoverySpec

    _use_compile_cache(ctx)
    gpus = 0 if ctx.cpu else torch.cuda.device_count()
    on_gpus = gpus >= 2
    world = gpus if on_gpus else 2
    train: dict[str, Any] = {}
    if not on_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # its ranks: gloo on CPU
        train = {"code": str(REPO), "entrypoint": "bench.first_contact:compiled_rank_script"}
    shutil.rmtree(ctx.work / "fc-ddp", ignore_errors=True)
    job = make_job(ctx, "fc-ddp", world, steps=2, **train)
    # The largest tolerance the spec allows: this check is about the reducer, not the drift.
    job.shadow = RecoverySpec(shadow_every=1, shadow_rtol=0.1).shadow_settings()
    job.layout = {"replicate": world, "shard": 1, "tensor": 1}
    log = Path(job.progress_file).parent / "torchrun.log"
    figures: dict[str, Any] = {"ranks": world, "device": "cuda" if on_gpus else "cpu"}
    try:
        tail_, _ = asyncio.run(_run_job(ctx, job, world, budget_s - 10, warm=False))
    except Exception as err:
        reducer = REDUCER_ERROR in tail(log, 200_000)
        figures["reducer_error"] = reducer
        return [Result("ddp_compile_shadow", ok=False, figures=figures, error=error_text(err))]
    events = progress_events(job)
    agreed = [e["step"] for e in events if e.get("event") == "shadow_check" and e.get("agreed")]
    mismatches = [e for e in events if "shadow-mismatch" in json.dumps(e)]
    figures.update(steps=tail_.latest.get("step"), agreed_at=agreed, mismatches=len(mismatches),
                   reducer_error=REDUCER_ERROR in tail(log, 200_000))  # fmt: skip
    ok = tail_.finished and agreed == [1, 2] and not figures["reducer_error"]
    error = None if ok else f"shadow checks agreed at {agreed}, not [1, 2]; {mismatches[:1]}"
    return [Result("ddp_compile_shadow", ok=ok, figures=figures, error=error)]


# ---- 8. FSDP2 with the gradient watch off and on --------------------------------------------


def rank_fsdp(workdir: Path) -> None:
    """FSDP2 over every rank (`shard` = GPU count) training the same batch, first plain, then
    with the SDK's reduce-scatter watch (trainer.shard_watch, as run.restore installs it): the
    host syncs per step (torch.cuda.set_sync_debug_mode) and the time of a step, each way."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from trainer import runtime
    from trainer.model import GPT, GPTConfig
    from trainer.parallel import Layout, build_mesh, parallelize
    from trainer.shard_watch import ShardedPreReduceNorms

    ctx = Context.from_env()
    with reporting_rank(workdir) as data:
        rt = runtime.start(0, 120)
        shape, layout = ctx.medium, Layout(shard=rt.world)
        torch.manual_seed(0)
        model = GPT(GPTConfig(**shape.config())).to(rt.device)
        placement = build_mesh(layout, rt.device.type)
        if rt.world > 1:
            parallelize(model, layout, placement)
        else:  # parallelize leaves a world of one unsharded: shard as it would
            policy = _fsdp_policy(rt.device.type)
            for block in model.blocks:
                fully_shard(block, mesh=placement.mesh["shard"], **policy)
            fully_shard(model, mesh=placement.mesh["shard"], **policy)
        data["sharded_by"] = "parallelize" if rt.world > 1 else "fully_shard (world of one)"
        optimizer = model.optimizer(1e-4, 0.1)
        x, y = random_batch(shape, rt.device, seed=rt.rank)
        watch: list[ShardedPreReduceNorms] = []

        def step() -> None:
            with rt.autocast():
                _, loss = model(x, y)
            loss.backward()
            if watch:
                watch[0].take()  # the SDK reads it once a step (Step.gradients)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for label in ("off", "on"):
            if label == "on":
                watch.append(ShardedPreReduceNorms(model))
            step()  # warm-up
            syncs, seconds = _syncs_and_time(step, 3, rt.is_cuda)
            data[f"syncs_per_step_{label}"] = syncs
            data[f"step_ms_{label}"] = round(seconds * 1000, 2)
        runtime_units = sum(1 for m in model.modules() if hasattr(m, "set_custom_reduce_scatter"))
        data["fsdp_units"] = runtime_units


def _fsdp_policy(device_type: str) -> dict[str, Any]:
    """The mixed precision parallelize gives FSDP on this device, where the trainer has one
    (trainer.parallel.precision_for); FSDP's default otherwise."""
    from trainer import parallel

    precision_for = getattr(parallel, "precision_for", None)
    return {"mp_policy": precision_for(device_type).fsdp} if precision_for else {}


def _syncs_and_time(step: Callable[[], None], steps: int, cuda: bool) -> tuple[float | None, float]:
    """Host syncs per step (None without CUDA: nothing to count) and seconds per step."""
    import torch

    if not cuda:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        return None, (time.perf_counter() - started) / steps
    torch.cuda.synchronize()
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / steps
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return syncs / steps, seconds


def check_fsdp_grad_watch(ctx: Context, budget_s: float) -> list[Result]:
    world = ctx.world()
    rc, reports, log = launch_ranks(ctx, "fsdp", world, ctx.work / "fsdp", budget_s - 5)
    error = rank_errors(reports, rc, log)
    first = reports[0] if reports else {}
    keys = ("sharded_by", "fsdp_units", "syncs_per_step_off", "syncs_per_step_on",
            "step_ms_off", "step_ms_on")  # fmt: skip
    figures = {"ranks": world, **{k: first.get(k) for k in keys}}
    if ctx.cpu:
        figures["syncs"] = f"skipped: {NEEDS_CUDA}"
    return [Result("fsdp_grad_watch", ok=error is None, figures=figures, error=error)]


# ---- 8b. a 2-stage pipeline ----------------------------------------------------------------

PIPELINE_MICROBATCHES = 4


def rank_pipeline(workdir: Path) -> None:
    """The built-in GPT as a 2-stage 1F1B pipeline (trainer.gpt_stages, trainer.pipeline) on the
    runtime's devices and process group, as a run's ranks build it: three steps; the first
    step's loss against the whole model's on one device (same initial weights, same batch), and
    the step time."""
    import torch

    from trainer import runtime
    from trainer.gpt_stages import build_stages, stage_loss
    from trainer.model import GPT, GPTConfig, adamw
    from trainer.parallel import Layout, build_mesh
    from trainer.pipeline import Pipeline, PipelineSettings

    ctx = Context.from_env()
    with reporting_rank(workdir) as data:
        rt = runtime.start(0, 120)
        shape = ctx.small
        config = GPTConfig(**{**shape.config(), "n_layer": 2 * shape.n_layer})
        layout = Layout(pipeline=rt.world)
        settings = PipelineSettings(rt.world, "1F1B", 1, PIPELINE_MICROBATCHES)
        placement = build_mesh(layout, rt.device.type)
        staged = build_stages(config, 0, layout, placement, rt.device, settings)
        pipeline = Pipeline(staged.parts, settings, placement.mesh, rt.device, stage_loss,
                            staged.tied)  # fmt: skip
        optimizer = adamw(staged.module, 1e-4, 0.1)
        x, y = random_batch(shape, rt.device, seed=0)
        losses, times = [], []
        for _ in range(3):
            started = time.perf_counter()
            with rt.autocast():
                loss = pipeline.step(x, y)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))  # the step's sync point
            times.append(time.perf_counter() - started)
        data["losses"] = losses
        data["step_ms"] = round(min(times[1:]) * 1000, 2)
        if rt.rank == 0:
            torch.manual_seed(0)
            whole = GPT(config).to(rt.device)
            with torch.no_grad(), rt.autocast():
                data["whole_loss"] = float(whole(x, y)[1])


def check_pipeline(ctx: Context, budget_s: float) -> list[Result]:
    world = ctx.world()
    if world < 2:
        return [skipped("pipeline", "needs 2 GPUs", ranks=world)]
    rc, reports, log = launch_ranks(ctx, "pipeline", 2, ctx.work / "pipeline", budget_s - 5)
    error = rank_errors(reports, rc, log)
    first = reports[0] if reports else {}
    figures = {"ranks": 2, "microbatches": PIPELINE_MICROBATCHES,
               **{k: first.get(k) for k in ("losses", "whole_loss", "step_ms")}}  # fmt: skip
    if error is None:
        ours, whole = first["losses"][0], first["whole_loss"]
        # The same weights and batch: equal up to float rounding (bf16 autocast on a GPU).
        tolerance = 1e-4 if ctx.cpu else 2e-2
        if abs(ours - whole) > tolerance * max(1.0, abs(whole)):
            error = f"the pipeline's first loss {ours} is not the whole model's {whole}"
        elif reports[1].get("losses") != first["losses"]:
            error = f"the stages report different losses: {[r.get('losses') for r in reports]}"
    return [Result("pipeline", ok=error is None, figures=figures, error=error)]


# ---- 9. evaluation and sampling -------------------------------------------------------------


def word_tokenizer(vocab: int, path: Path) -> Path:
    """A tokenizer whose words `t0`..`t<vocab-1>` are the model's ids (the job's data is
    random ids, not text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def check_evaluate_sample(ctx: Context, budget_s: float) -> list[Result]:
    """The `job` check's checkpoint through evaluation (trainer/evaluate.py, as the EVALUATING
    phase runs it), held-out loss and sampling (trainer/sampling.py) with the model on the
    device, and the registered version's generator (trainer/serving.py)."""
    import torch
    from tokenizers import Tokenizer

    from infra.store.local import LocalStore
    from trainer.checkpoint import fetch_checkpoint
    from trainer.data import TokenStream
    from trainer.evaluate import evaluate_checkpoint, held_out_loss, load_model
    from trainer.manifest import find_latest
    from trainer.sampling import sample_text
    from trainer.serving import TextGenerator, export_model

    store = LocalStore(ctx.work / JOB_RUN / "store")
    latest = find_latest(store, JOB_RUN, 1)
    if latest is None:
        return [Result("evaluate_sample", ok=False, error="no checkpoint: the job check failed")]
    folder = fetch_checkpoint(store, latest.manifest, ctx.work / "eval" / "checkpoint")
    config = latest.manifest.network
    tokenizer_file = word_tokenizer(config["vocab_size"], ctx.work / "eval" / "tokenizer.json")
    _, val = token_files(ctx, ctx.small)
    prompt = "t1 t2 t3"
    figures: dict[str, Any] = {"step": latest.step}
    problems: list[str] = []
    # The product's path, as it is: it loads the model where evaluate.load_model puts it.
    evaluation = evaluate_checkpoint(
        checkpoint_folder=folder, model_config=config, val_shards=[val], dtype="uint16",
        tokenizer_file=tokenizer_file, batch_size=4, max_batches=4, prompts=[prompt],
        sample_tokens=8, seed=0,
    )  # fmt: skip
    figures["val_loss"] = evaluation.val_loss
    figures["evaluate_device"] = str(next(load_model(folder, config).parameters()).device)
    device = torch.device("cpu" if ctx.cpu else "cuda:0")
    model = load_model(folder, config).to(device)
    stream = TokenStream([val], "uint16", model.config.block_size)
    loss, _ = held_out_loss(model, stream, 4, 4)
    figures["val_loss_on_device"] = loss
    figures["device_vs_evaluate"] = abs(loss - evaluation.val_loss) / max(
        abs(loss), abs(evaluation.val_loss)
    )
    if figures["device_vs_evaluate"] > 1e-2:  # TF32 or another reduction order: not 1 %
        problems.append(f"held-out loss on {device} {loss} against {evaluation.val_loss}")
    try:
        text = sample_text(model, Tokenizer.from_file(str(tokenizer_file)), prompt, 8, 0)
        figures["sample_on_device"] = text[:60]
    except Exception as err:
        figures["sample_on_device"] = None
        problems.append(f"sample_text with the model on {device}: {type(err).__name__}: {err}")
    served = ctx.work / "eval" / "served"
    export_model(load_model(folder, config), tokenizer_file, served)
    generator = TextGenerator(served / "model.safetensors", served / "model_config.json",
                              served / "tokenizer.json")  # fmt: skip
    figures["serving_device"] = str(next(generator.model.parameters()).device)
    figures["served_sample"] = generator.generate(prompt, 8, 0)[:60]
    return [Result("evaluate_sample", ok=not problems, figures=figures,
                   error="; ".join(problems) or None)]  # fmt: skip


# ---- 10. bench/gpu.sh -----------------------------------------------------------------------


def check_gpu_sh(ctx: Context, budget_s: float, rc: int, folder: Path) -> list[Result]:
    """What bench/gpu.sh's trainer reported (its progress file), and its exit status."""
    if ctx.cpu:
        return [skipped("gpu_sh")]
    path = folder / "progress.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    steps = [e for e in events if e.get("event") == "step"]
    steady = [e for e in steps if e["step"] > 5] or steps
    figures = {
        "rc": rc,
        "steps": steps[-1]["step"] if steps else 0,
        "tokens_per_s": max((e["tokens_per_s"] for e in steady), default=None),
        "mfu": max((e.get("mfu") or 0.0 for e in steady), default=None),
        "last_loss": steps[-1]["loss"] if steps else None,
    }
    ok = rc == 0 and bool(steps)
    error = None if ok else f"bench/gpu.sh exited {rc} after {len(steps)} steps"
    return [Result("gpu_sh", ok=ok, figures=figures, error=error)]


# ---- the command line -----------------------------------------------------------------------

CHECKS: dict[str, Callable[[Context, float], list[Result]]] = {
    "versions": check_versions,
    "fork": check_fork,
    "job": check_job,
    "process_groups": check_process_groups,
    "checkpoint": check_checkpoint,
    "shadow_drift": check_shadow_drift,
    "ddp_compile_shadow": check_ddp_compile_shadow,
    "fsdp_grad_watch": check_fsdp_grad_watch,
    "pipeline": check_pipeline,
    "evaluate_sample": check_evaluate_sample,
}
RANKS: dict[str, Callable[[Path], None]] = {
    "fork_child": rank_fork_child,
    "process_groups": rank_process_groups,
    "checkpoint": rank_checkpoint,
    "fsdp": rank_fsdp,
    "pipeline": rank_pipeline,
}


def run_check(ctx: Context, name: str, results: Callable[[], list[Result]]) -> int:
    """Run one check; record each of its results, or its error under each name it owes."""
    started = time.monotonic()
    try:
        found = results()
    except BaseException as err:  # Stopped (the timeout) included: recorded, then exit
        found = [Result(n, ok=False, error=error_text(err)) for n in RECORDS[name]]
    for result in found:
        result.seconds = round(time.monotonic() - started, 1)
        record(ctx, result)
    return 0 if all(r.ok for r in found) else 1


def settle(ctx: Context, name: str, rc: int, log: Path) -> int:
    """After a check's process: a failure for each result it owes and did not record (killed
    past its timeout, or it never started), then its lines again, for the script's output."""
    done = {r["check"] for r in read_results(ctx)}
    for owed in RECORDS[name]:
        if owed not in done:
            why = "timed out" if rc in (124, 137) else f"exited {rc} without a result"
            record(ctx, Result(owed, ok=False, error=f"{why}; its log:\n{tail(log)}"))
    return 0


def summary(ctx: Context) -> int:
    """The table of every check in order; 1 if any failed or never recorded."""
    results = {r["check"]: r for r in read_results(ctx)}
    print(f"\n{'check':<20} {'result':<6} {'seconds':>7}  figures / why")
    failed = 0
    for name in (n for names in RECORDS.values() for n in names):
        result = results.get(name)
        if result is None:
            print(f"{name:<20} {'MISS':<6} {'':>7}  no result recorded")
            failed += 1
            continue
        line = human_line(result).removeprefix("[first-contact] ")
        print(line[:20] + " " + line[21:])
        failed += not result["ok"]
    print(f"\n{len(results)} results in {ctx.out / RESULTS}; {failed} failed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fork-parent":  # torchrun's arguments follow `--`
        fork_parent(argv[2:])
        return 0
    if argv and argv[0] == "rank":  # a rank under torchrun: `rank NAME WORKDIR`
        RANKS[argv[1]](Path(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=[*CHECKS, "gpu_sh", "settle", "summary"])
    parser.add_argument("name", nargs="?", help="settle: the check")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds the check may take")
    parser.add_argument("--rc", type=int, default=0, help="settle, gpu_sh: the exit status")
    parser.add_argument("--log", type=Path, default=Path("/dev/null"))
    parser.add_argument("--dir", type=Path, help="gpu_sh: bench/gpu.sh's OUT")
    args = parser.parse_args(argv)
    ctx = Context.from_env()
    if args.command == "summary":
        return summary(ctx)
    if args.command == "settle":
        return settle(ctx, args.name, args.rc, args.log)
    _stop_on_sigterm()
    if args.command == "gpu_sh":
        return run_check(ctx, "gpu_sh", lambda: check_gpu_sh(ctx, args.budget, args.rc, args.dir))
    check = CHECKS[args.command]
    return run_check(ctx, args.command, lambda: check(ctx, args.budget))


if __name__ == "__main__":
    # Under torchrun a rank returns rather than exits: torch's fork wrapper reports its result.
    if code := main():
        sys.exit(code)
