"""`forgeline plan SPEC [--cluster FILE]`: what a run will need before it asks for a GPU.

Parameters, bytes of training state, memory per GPU for the spec's layout (fits or not, why,
and what would), FLOPs, time and cost of the token budget, failures, checkpoints and goodput.
The arithmetic is infra/capacity*.py; this module reads the spec and prints.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from infra.capacity import PRECISIONS, Pipelining, Precision, Shape
from infra.capacity_hardware import Hardware, PlanError, load_hardware
from infra.capacity_layouts import Candidate
from infra.capacity_layouts import propose as layout_proposals
from infra.capacity_plan import GIB, Budget, Layout, Plan, make_plan, what_would_fit
from worker.cli_common import CliError, console
from worker.specfile import SpecError, load_spec
from workflows.contracts.cluster_models import ClusterConfig
from workflows.contracts.spec import RunSpec

commands = typer.Typer()

PrecisionName = Enum("PrecisionName", {name: name for name in PRECISIONS}, type=str)  # type: ignore[misc]

# The char tokenizer's vocabulary is the corpus's alphabet, unknown until data prep: 256 bounds
# any single-byte alphabet and costs a small model nothing it would notice.
_CHAR_VOCAB, _BYTE_VOCAB = 256, 257  # byte: 256 bytes + end-of-document


def vocab_for(spec: RunSpec, vocab: int | None) -> tuple[int, str]:
    if vocab is not None:
        return vocab, "--vocab"
    if spec.data.tokenizer == "bpe":
        return spec.data.vocab_size, "data.vocab_size (bpe)"
    if spec.data.tokenizer == "byte":
        return _BYTE_VOCAB, "byte tokenizer: 256 bytes + end-of-document"
    return _CHAR_VOCAB, "char tokenizer: assumed, known after data prep (pass --vocab N)"


def _count(n: float) -> str:
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f}"


def _bytes(n: float) -> str:
    for size, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):,.2f} MiB"


def _duration(s: float) -> str:
    if math.isinf(s):
        return "never (goodput 0)"
    if s >= 2 * 86400:
        return f"{s / 86400:,.1f} days"
    for size, unit in ((3600, "h"), (60, "min")):
        if s >= size:
            return f"{s:,.0f} s ({s / size:,.1f} {unit})"
    return f"{s:,.3g} s"


@dataclass(frozen=True)
class Inputs:
    """Everything the arithmetic takes, and where each assumption came from."""

    shape: Shape
    layout: Layout
    budget: Budget
    precision: Precision
    hardware: Hardware
    node_mtbf_hours: float
    notes: dict[str, str]


def inputs_for(spec: RunSpec, hardware: Hardware, vocab: int | None, precision: str) -> Inputs:
    vocab_size, vocab_note = vocab_for(spec, vocab)
    m, r = spec.model, spec.resources
    replicate, shard, tensor = spec.parallel.degrees(r.world_size)
    every = spec.train.checkpoint_every
    mtbf = hardware.node_mtbf_hours or spec.recovery.node_mtbf_hours
    bandwidth = f"{hardware.write_gb_per_s_per_node:g} GB/s per node × {r.nodes}"
    if hardware.write_gb_per_s is not None:
        bandwidth += f", at most {hardware.write_gb_per_s:g} GB/s"
    return Inputs(
        shape=Shape(
            vocab_size, m.n_layer, m.n_head, m.n_embd, m.block_size, m.rope, m.swiglu, m.bias
        ),
        layout=Layout(
            r.nodes,
            r.gpus_per_node,
            replicate,
            shard,
            tensor,
            spec.parallel.activation_checkpointing,
            pipelining(spec),
        ),
        budget=Budget(
            spec.train.steps,
            spec.train.batch_size,
            spec.train.grad_accum_steps,
            None if every == "auto" else every,
        ),
        precision=PRECISIONS[precision],
        hardware=hardware,
        node_mtbf_hours=mtbf,
        notes={
            "vocab": f"{vocab_size:,} ({vocab_note})",
            "throughput": f"{r.world_size} GPUs × {hardware.peak_flops_per_gpu:.3g} FLOP/s × "
            f"MFU {hardware.mfu:g}" + (" × (1 − bubble)" if spec.parallel.pipeline > 1 else ""),
            "mtbf": f"node MTBF {mtbf:g} h / {r.nodes} nodes"
            + ("" if hardware.node_mtbf_hours else " (recovery.node_mtbf_hours)"),
            "bandwidth": bandwidth,
            "interval": "Daly's (checkpoint_every = auto)"
            if every == "auto"
            else f"checkpoint_every = {every} steps",
            "layout": _pipeline_note(spec)
            + f"replicate {replicate} × shard {shard} × tensor {tensor}"
            + _recompute_note(spec.parallel.activation_checkpointing),
        },
    )


def pipelining(spec: RunSpec) -> Pipelining:
    """The spec's pipeline, with the micro-batches the ranks will split each batch into."""
    parallel = spec.parallel
    if parallel.pipeline == 1:
        return Pipelining()
    replicate, shard, _ = parallel.degrees(spec.resources.world_size)
    local = spec.train.batch_size // (replicate * shard)
    return Pipelining(
        parallel.pipeline, parallel.virtual_stages, parallel.microbatches_for(local),
        parallel.schedule,
    )  # fmt: skip


def _pipeline_note(spec: RunSpec) -> str:
    parallel = spec.parallel
    if parallel.pipeline == 1:
        return ""
    return f"pipeline {parallel.pipeline} ({parallel.schedule}) × "


def _recompute_note(mode: str) -> str:
    return "" if mode == "none" else f", activation checkpointing {mode}"


def _placement(spec: RunSpec) -> tuple[str, str]:
    """Where the gang may go in the fabric (resources.topology), and why it matters."""
    resources = spec.resources
    level, wait = resources.topology, resources.topology_wait_min
    if resources.nodes == 1:
        return "one node", "a gang's nodes are whole"
    if level is None:
        spread = "any pods" if resources.allow_multi_pod else "one pod"
        return "packed", f"the smallest unit that holds it, else the fewest units; {spread}"
    if wait is None:
        return f"one {level}", "required: it waits for a whole one (resources.topology)"
    if wait == 0:
        return f"one {level} if free", f"else the fewest {level}s at once (topology_wait_min = 0)"
    return f"one {level}", f"waits {wait:g} min for one, then the fewest {level}s"


def _table(spec: RunSpec, plan: Plan, given: Inputs) -> Table:
    notes, hardware = given.notes, given.hardware
    table = Table(title=f"plan for {spec.name}: {notes['layout']}")
    for column in ("figure", "value", "how"):
        table.add_column(column, overflow="fold")
    p, m = plan.precision, plan.memory
    per = f"{p.weights} + {p.grads} + {p.master} + {p.moments}"
    rows: list[tuple[str, str, str]] = [
        ("parameters", _count(plan.params), f"vocab {notes['vocab']}"),
        ("non-embedding parameters", _count(plan.non_embedding_params), "N in 6N"),
        ("FLOPs per token", f"{plan.flops_per_token:.3e}", "PaLM: 6N + 12·L·H·Q·T"),
        (
            f"training state ({p.name})",
            _bytes(plan.model_state_bytes),
            f"{p.per_param} B/param = weights + grads + master + moments = {per}",
        ),
        ("micro-batch per rank", f"{plan.micro_batch} × {spec.model.block_size} tokens", ""),
        *_pipeline_rows(plan, given),
        ("placement", *_placement(spec)),
    ]
    rows += [(f"  {name} / GPU", _gib(v), "") for name, v in m.parts().items() if v]
    rows += [
        ("memory / GPU", _gib(m.total), f"usable {_gib(plan.usable_memory_bytes)}"),
        ("tokens", _count(plan.tokens), "steps × batch_size × block_size"),
        ("throughput", f"{_count(plan.tokens_per_s)} tokens/s", notes["throughput"]),
        ("step time", _duration(plan.step_s), ""),
        ("compute time", _duration(plan.compute_s), "at the assumed MFU, no failures"),
        ("gang MTBF", _duration(plan.gang_mtbf_s), notes["mtbf"]),
        ("checkpoint", _bytes(plan.checkpoint_bytes), f"{p.checkpoint_per_param} B/param"),
        ("  per rank", _bytes(plan.checkpoint_bytes_per_rank), "each rank writes its shard"),
        ("save time", _duration(plan.save_s), notes["bandwidth"]),
        ("Young interval", _duration(plan.young_s), "√(2·C·M)"),
        ("Daly interval", _duration(plan.daly_s), "√(2·C·M) − C (what auto uses)"),
        ("checkpoint interval", _duration(plan.interval_s), notes["interval"]),
        ("goodput", f"{plan.goodput:.1%}", f"{plan.goodput_optimal:.1%} at Daly's interval"),
        ("wall-clock time", _duration(plan.wall_s), "compute time / goodput"),
        ("expected failures", f"{plan.expected_failures:,.1f}", "wall-clock / gang MTBF"),
        (
            "GPU-hours",
            f"{plan.gpu_hours:,.3g}" if plan.gpu_hours < 1000 else f"{plan.gpu_hours:,.0f}",
            f"{spec.resources.world_size} GPUs × wall-clock",
        ),
        (
            "cost per hour",
            f"${plan.cost_per_hour:,.2f}",
            f"${hardware.cost_per_gpu_hour:g}/GPU-hour",
        ),
        ("cost", f"${plan.cost:,.2f}" if plan.cost < 1000 else f"${plan.cost:,.0f}", ""),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _micro(count: float) -> str:
    return f"{count:g} micro-batch" + ("" if count == 1 else "es")


def _pipeline_rows(plan: Plan, given: Inputs) -> list[tuple[str, str, str]]:
    pipe = given.layout.pipeline
    if pipe.ranks == 1:
        return []
    v = f" × {pipe.stages_per_rank} stages a rank" if pipe.stages_per_rank > 1 else ""
    return [
        (
            "pipeline",
            f"{pipe.ranks} ranks{v}, {_micro(pipe.microbatches)}",
            f"{pipe.schedule}; activations of {_micro(pipe.in_flight())} held at once",
        ),
        ("  bubble", f"{plan.bubble:.1%}", "(P − 1)/(v·M + P − 1); zero-bubble: a third of it"),
        (
            "  point-to-point / step",
            _bytes(plan.pipeline_bytes_per_step),
            "activations forward, their gradients back, 16-bit, a rank",
        ),
    ]


def proposed(given: Inputs) -> list[Candidate]:
    layout = given.layout
    return layout_proposals(given.shape, layout.world, layout.gpus_per_node,
                            replace(given.budget, grad_accum_steps=1), given.precision,
                            given.hardware)  # fmt: skip


def _proposals_table(proposals: list[Candidate], given: Inputs) -> Table:
    world = given.layout.world
    table = Table(
        title=f"layouts of {world:,} GPUs that fit, by estimated MFU (infra/capacity_layouts.py)"
    )
    for column in ("layout", "memory / GPU", "bubble", "TP / step", "DP exposed", "step", "MFU"):
        table.add_column(column, overflow="fold")
    for c in proposals:
        table.add_row(
            c.describe(), _gib(c.memory_bytes), f"{c.bubble:.1%}", _duration(c.tensor_s),
            _duration(c.data_exposed_s), _duration(c.step_s), f"{c.mfu:.1%}",
        )  # fmt: skip
    if not proposals:
        table.add_row("nothing fits: more GPUs, or a smaller model or batch", *[""] * 6)
    return table


def verdicts(plan: Plan, given: Inputs) -> list[str]:
    """Fits or not and why (and what would), then the reliability in one line."""
    m, hardware, usable = plan.memory, given.hardware, plan.usable_memory_bytes
    name, biggest = m.dominant()
    attention = "fused attention" if hardware.flash_attention else "attention scores stored"
    mode = given.layout.recompute
    recomputation = "no recomputation" if mode == "none" else f"{mode} recomputation"
    lines = [
        f"memory: {'fits' if plan.fits else 'does NOT fit'}: {_gib(m.total)} per GPU against "
        f"{_gib(usable)} usable ({hardware.usable_memory_fraction:.0%} of "
        f"{hardware.gpu_memory_gib:g} GiB); largest part: {name} ({_gib(biggest)}); activations "
        f"are an estimate (Korthikanti et al. 2022, {recomputation}, {attention})"
    ]
    if not plan.fits:
        change = what_would_fit(given.shape, given.layout, given.budget, given.precision, hardware)
        if change is None:
            lines.append("  nothing fits on this gang: add nodes, or shrink the model or batch")
        else:
            keys = {"accum": "train.grad_accum_steps"}
            said = ", ".join(
                f"{keys.get(k, 'parallel.' + k)} = {json.dumps(v)}" for k, v in change.items()
            )
            lines.append(f"  {said} would fit")
    if given.layout.gpus_per_node > hardware.gpus_per_node:
        lines.append(
            f"resources.gpus_per_node ({given.layout.gpus_per_node}) exceeds the cluster's "
            f"gpus_per_node ({hardware.gpus_per_node}): nodes that big are not assumed"
        )
    if plan.interval_s < plan.save_s:
        lines.append(
            f"checkpoints: the interval ({_duration(plan.interval_s)}) is shorter than a save "
            f"({_duration(plan.save_s)}): saves would queue; Daly's is {_duration(plan.daly_s)}"
        )
    lines.append(
        f"reliability: {plan.expected_failures:,.1f} failures expected over the run, goodput "
        f"{plan.goodput:.1%} (first-order Young/Daly: each failure loses half an interval and "
        f"the {hardware.restart_s:g} s restart; saves counted as blocking, an async save "
        "stalls less)"
    )
    return lines


def _finite(value: object) -> object:
    if isinstance(value, float) and math.isinf(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def as_json(plan: Plan, given: Inputs) -> dict:
    return _finite(
        {
            "inputs": {
                "shape": asdict(given.shape),
                "layout": asdict(given.layout),
                "budget": asdict(given.budget),
                "hardware": asdict(given.hardware),
                "node_mtbf_hours": given.node_mtbf_hours,
                "notes": given.notes,
            },
            **asdict(plan),
            "memory": {**asdict(plan.memory), "total": plan.memory.total},
            "fits": plan.fits,
            "would_fit": None
            if plan.fits
            else what_would_fit(
                given.shape, given.layout, given.budget, given.precision, given.hardware
            ),
        }
    )  # type: ignore[return-value]


@commands.command()
def plan(
    spec_file: Annotated[Path, typer.Argument(help="run spec (TOML)")],
    cluster: Annotated[
        Path | None,
        typer.Option(
            help="hardware assumptions (TOML; default an H100 node, see "
            "examples/plan-h100.toml); a `cluster apply` file works too"
        ),
    ] = None,
    vocab: Annotated[
        int | None, typer.Option(min=1, help="vocabulary size (default: from data.tokenizer)")
    ] = None,
    precision: Annotated[
        PrecisionName, typer.Option(help="bf16-mixed: bf16 weights, fp32 master and moments")
    ] = PrecisionName["bf16-mixed"],  # type: ignore[assignment]
    as_json_: Annotated[bool, typer.Option("--json", help="the numbers as JSON")] = False,
    propose: Annotated[
        bool,
        typer.Option(
            "--propose",
            help="also rank the layouts of the spec's GPUs that fit (tensor × pipeline × data "
            "parallel, recomputation, schedule) by their estimated MFU",
        ),
    ] = False,
) -> None:
    """What a run needs: parameters, memory per GPU (fits or not), time, cost, failures,
    checkpoint interval and goodput, for the spec's layout on the assumed hardware."""
    try:
        spec = load_spec(spec_file)
        cluster_keys = frozenset(ClusterConfig.model_fields)
        hardware = load_hardware(cluster, cluster_keys) if cluster else Hardware()
    except SpecError as err:
        raise CliError(f"{spec_file}: {err}") from None
    except PlanError as err:  # names the file already
        raise CliError(str(err)) from None
    if spec.train.user_code:
        # The arithmetic needs the network's shape, and a user's script declares none: sizing
        # the spec's [model] (the built-in GPT's, ignored by the script) would be a plan of
        # something else.
        raise CliError(
            f"{spec_file}: this spec runs your own code (train.entrypoint = "
            f"{spec.train.entrypoint!r}), and forgeline plan sizes only the built-in GPT from "
            "[model]; to plan a GPT of about your model's size, plan a copy of the spec without "
            "train.code and train.entrypoint, with a [model] of that size"
        )
    given = inputs_for(spec, hardware, vocab, precision.value)
    result = make_plan(
        given.shape, given.layout, given.budget, given.precision, hardware, given.node_mtbf_hours
    )
    proposals = proposed(given) if propose else []
    if as_json_:
        numbers = as_json(result, given)
        if propose:
            numbers["proposals"] = [_finite(asdict(c)) for c in proposals]
        typer.echo(json.dumps(numbers, indent=2))
        return
    console.print(_table(spec, result, given))
    if propose:
        console.print(_proposals_table(proposals, given))
    for line in verdicts(result, given):
        console.print(line)
