"""Capacity planning: the seeds' arithmetic, the closed-form parameter count against torch, memory
verdicts, and `forgeline plan` end to end on real spec files."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from infra.capacity import (
    PRECISIONS,
    Pipelining,
    Shape,
    flops_per_token,
    memory_per_gpu,
    model_state_bytes,
    non_embedding_params,
    param_count,
    stage_params,
)
from infra.capacity_hardware import Hardware, PlanError, hardware_from_dict, load_hardware
from infra.capacity_layouts import propose
from infra.capacity_plan import (
    GIB,
    Budget,
    Layout,
    daly_interval_s,
    gang_mtbf_s,
    goodput,
    make_plan,
    what_would_fit,
    young_interval_s,
)
from workflows.contracts.cluster_models import ClusterConfig
from workflows.contracts.spec import ParallelSpec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MIXED = PRECISIONS["bf16-mixed"]
# Llama-2-70B's width and depth with this repo's GPT (SwiGLU 8C/3, no GQA): about 65 B.
BIG = Shape(32000, n_layer=80, n_head=64, n_embd=8192, block_size=4096, rope=True, swiglu=True,
            bias=False)  # fmt: skip


def test_500_nodes_at_a_six_month_mtbf_fail_every_9_hours() -> None:
    assert gang_mtbf_s(4380, 500) / 3600 == pytest.approx(8.76)


def test_a_30s_save_at_an_8h_mtbf_checkpoints_every_22_minutes() -> None:
    young = young_interval_s(30, 8 * 3600)
    assert young == pytest.approx(math.sqrt(2 * 30 * 28800)) and round(young / 60) == 22
    assert daly_interval_s(30, 8 * 3600) == pytest.approx(young - 30)
    assert daly_interval_s(5000, 8000) == 8000  # C ≥ M/2: once per MTBF


def test_70b_parameters_at_16_bytes_are_1_1_tb() -> None:
    assert model_state_bytes(70_000_000_000, MIXED) == 1.12e12
    assert PRECISIONS["fp32"].per_param == 16 and PRECISIONS["bf16"].per_param == 8
    assert MIXED.checkpoint_per_param == 12  # master weights + two moments


def test_4096_gpus_at_2_dollars_cost_8192_an_hour() -> None:
    layout = Layout(nodes=512, gpus_per_node=8, replicate=512, shard=8, tensor=1)
    plan = make_plan(BIG, layout, Budget(10, 4096), MIXED, Hardware(cost_per_gpu_hour=2.0), 4380)
    assert plan.cost_per_hour == 8192
    assert plan.cost == pytest.approx(plan.gpu_hours * 2)


def test_daly_interval_is_the_best_goodput() -> None:
    save, mtbf, restart = 30.0, 8 * 3600.0, 300.0
    best = goodput(save, daly_interval_s(save, mtbf), restart, mtbf)
    for factor in (0.25, 0.5, 2, 4):
        assert goodput(save, factor * daly_interval_s(save, mtbf), restart, mtbf) < best


def test_a_preemption_costs_its_save_and_resume_but_no_work() -> None:
    """A preemption once an hour costs (save + resume) / hour; a failure as often costs half a
    period more, the work since the last checkpoint."""
    save, interval, restart, hour = 10.0, 590.0, 60.0, 3600.0
    quiet = goodput(save, interval, restart, math.inf)
    preempted = goodput(save, interval, restart, math.inf, mtbp_s=hour, resume_s=20.0)
    failing = goodput(save, interval, restart, hour)
    assert quiet - preempted == pytest.approx((save + 20.0) / hour)
    assert quiet - failing == pytest.approx((300.0 + restart) / hour)
    assert goodput(save, interval, restart, math.inf, mtbp_s=hour) == pytest.approx(
        quiet - (save + restart) / hour
    )


@pytest.mark.parametrize(
    "shape",
    [
        Shape(65, n_layer=4, n_head=4, n_embd=128, block_size=128),
        Shape(257, n_layer=2, n_head=2, n_embd=64, block_size=64, rope=True, swiglu=True),
        Shape(1000, n_layer=3, n_head=5, n_embd=200, block_size=32, swiglu=True),  # 8C/3 → 544
        Shape(65, n_layer=2, n_head=4, n_embd=64, block_size=32, swiglu=True, bias=False),
    ],
)
def test_closed_form_matches_the_torch_model(shape: Shape) -> None:
    from trainer.metrics import flops_per_token as trainer_flops
    from trainer.model import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=shape.vocab_size,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        block_size=shape.block_size,
        rope=shape.rope,
        swiglu=shape.swiglu,
        fused_qkv=not shape.bias,  # either way: the fused layout counts as the separate one
        bias=shape.bias,
    )
    model = GPT(config)
    assert param_count(shape) == sum(p.numel() for p in model.parameters())
    assert non_embedding_params(shape) == model.num_params()
    assert flops_per_token(shape) == trainer_flops(config, model.num_params())


def test_70b_replicated_does_not_fit_and_sharding_would() -> None:
    usable = 80 * GIB * Hardware().usable_memory_fraction
    replicated = memory_per_gpu(BIG, MIXED, shard=1, tensor=1, micro_batch=1, flash=True)
    assert replicated.total > usable
    assert replicated.moments == pytest.approx(param_count(BIG) * 8)

    layout = Layout(nodes=64, gpus_per_node=8, replicate=512, shard=1, tensor=1)
    budget = Budget(steps=10, batch_size=512)
    plan = make_plan(BIG, layout, budget, MIXED, Hardware(), 4380)
    assert not plan.fits and plan.memory.dominant()[0] == "training state"
    change = what_would_fit(BIG, layout, budget, MIXED, Hardware())
    # 4,096-token sequences of 8,192 channels keep 85 GiB of activations one at a time: sharded,
    # the selective recompute (no product computed again) brings them to 55 GiB, cheaper than
    # tensor parallelism or a full recompute.
    assert change == {"shard": 128, "replicate": 4, "activation_checkpointing": "selective"}
    changed = Layout(64, 8, 4, 128, 1, "selective")
    assert make_plan(BIG, changed, budget, MIXED, Hardware(), 4380).fits
    # A full recompute runs each forward twice: a third more time for each step.
    full = make_plan(BIG, replace(changed, recompute="full"), budget, MIXED, Hardware(), 4380)
    assert full.step_s == pytest.approx(plan.step_s * 4 / 3)
    assert full.memory.activations < changed_plan_activations(changed, budget) / 5

    # Sequences of 49,152 tokens outgrow a GPU even recomputed in full: it takes tensor
    # parallelism (a layer's working set split four ways) on top of full sharding.
    long = replace(BIG, block_size=49152)
    change = what_would_fit(long, layout, budget, MIXED, Hardware())
    assert change == {"tensor": 4, "shard": 128, "replicate": 1,
                      "activation_checkpointing": "full", "accum": 4}  # fmt: skip
    changed = Layout(64, 8, 1, 128, 4, "full")
    accumulated = Budget(steps=10, batch_size=512, grad_accum_steps=4)
    assert make_plan(long, changed, accumulated, MIXED, Hardware(), 4380).fits

    short = Shape(32000, n_layer=80, n_head=64, n_embd=8192, block_size=512, rope=True)
    assert what_would_fit(short, layout, budget, MIXED, Hardware()) == {
        "shard": 32,
        "replicate": 16,
    }


def changed_plan_activations(layout: Layout, budget: Budget) -> float:
    return make_plan(BIG, layout, budget, MIXED, Hardware(), 4380).memory.activations


def test_a_small_model_fits_one_gpu() -> None:
    tiny = Shape(65, n_layer=4, n_head=4, n_embd=128, block_size=128)
    plan = make_plan(tiny, Layout(1, 1, 1, 1, 1), Budget(600, 32), MIXED, Hardware(), 4380)
    assert plan.fits and plan.memory.total < GIB
    assert plan.tokens == 600 * 32 * 128
    assert what_would_fit(BIG, Layout(1, 1, 1, 1, 1), Budget(1, 1), MIXED, Hardware()) is None


def test_cluster_files_name_a_bad_key(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="unknown key 'mfuu'"):
        hardware_from_dict({"mfuu": 0.5}, "x.toml")
    with pytest.raises(PlanError, match=r"mfu = 1\.5 must be > 0 and ≤ 1"):
        hardware_from_dict({"mfu": 1.5}, "x.toml")
    with pytest.raises(PlanError, match=r"gpus_per_node = 8\.5 must be a whole number"):
        hardware_from_dict({"gpus_per_node": 8.5}, "x.toml")
    assert load_hardware(EXAMPLES / "plan-h100.toml") == Hardware(node_mtbf_hours=4380.0)
    with pytest.raises(PlanError, match="unknown key 'aging_s'"):
        load_hardware(EXAMPLES / "cluster.toml")
    scheduler_keys = frozenset(ClusterConfig.model_fields)
    assert load_hardware(EXAMPLES / "cluster.toml", scheduler_keys).cost_per_gpu_hour == 2.0


BIG_SPEC = """
name = "big-70b"
[data]
sources = ["corpus.txt"]
tokenizer = "bpe"
vocab_size = 32000
[model]
n_layer = 80
n_head = 64
n_embd = 8192
block_size = 4096
rope = true
swiglu = true
[train]
steps = 500000
batch_size = 1024
checkpoint_every = "auto"
[resources]
nodes = 512
gpus_per_node = 8
topology = "block"
topology_wait_min = 15
[parallel]
tensor = 8
shard = 1
"""


def test_the_plan_command(tmp_path: Path) -> None:
    # The command alone: importing all of worker.cli (MLflow, Temporal) would double this test.
    from worker.cli_common import CliError
    from worker.plan_cli import plan as plan_command

    app = typer.Typer()
    app.command("plan")(plan_command)
    app.callback()(lambda: None)  # a group, so `plan` is named as on the real CLI
    runner = CliRunner()
    small = runner.invoke(
        app,
        [
            "plan",
            str(EXAMPLES / "shakespeare-char.toml"),
            "--cluster",
            str(EXAMPLES / "cluster.toml"),
        ],
    )
    assert small.exit_code == 0, small.output
    assert "memory: fits" in small.output and "char tokenizer: assumed" in small.output

    (tmp_path / "corpus.txt").write_text("some text\n")
    (tmp_path / "big.toml").write_text(BIG_SPEC)
    big = runner.invoke(app, ["plan", str(tmp_path / "big.toml"), "--json"])
    assert big.exit_code == 0, big.output
    numbers = json.loads(big.output)
    assert numbers["params"] == param_count(BIG) and 64e9 < numbers["params"] < 66e9
    assert not numbers["fits"] and numbers["would_fit"]["shard"] > 1
    assert numbers["cost_per_hour"] == 8192
    assert numbers["gang_mtbf_s"] / 3600 == pytest.approx(4380 / 512)

    proposed = runner.invoke(app, ["plan", str(tmp_path / "big.toml"), "--json", "--propose"])
    assert proposed.exit_code == 0, proposed.output
    best = json.loads(proposed.output)["proposals"][0]
    assert best["layout"]["pipeline"]["ranks"] > 1 and best["mfu"] > 0.25

    table = runner.invoke(app, ["plan", str(tmp_path / "big.toml")])
    assert "does NOT fit" in table.output and "would fit" in table.output
    assert "waits 15 min for one, then the fewest blocks" in table.output

    # A user's script declares no shape: its spec's [model] would be a plan of something else.
    own = runner.invoke(app, ["plan", str(EXAMPLES / "byo" / "gru.toml")])
    assert isinstance(own.exception, CliError), own.output  # the CLI prints it as one line
    assert "runs your own code (train.entrypoint = 'train.py')" in str(own.exception)


def test_a_pipeline_divides_the_state_and_idles_for_its_bubble() -> None:
    one = memory_per_gpu(BIG, MIXED, shard=64, tensor=1, micro_batch=1, flash=True)
    staged = Pipelining(ranks=8, stages_per_rank=1, microbatches=32, schedule="1F1B")
    eight = memory_per_gpu(BIG, MIXED, 64, 1, 1, True, pipeline=staged)
    # An eighth of the blocks, and the embeddings whole on the first stage.
    assert eight.moments == pytest.approx(stage_params(BIG, 8) * 8 / 64)
    assert one.moments / 8 < eight.moments < one.moments / 7
    # 1F1B holds P micro-batches of activations, each for 1/P of the layers: one model's worth.
    assert eight.activations == pytest.approx(one.activations)
    assert staged.bubble() == pytest.approx(7 / 39)
    interleaved = replace(staged, stages_per_rank=2, schedule="interleaved-1F1B")
    assert interleaved.bubble() == pytest.approx(7 / 71)
    assert interleaved.in_flight() == pytest.approx(8 * (1 + 7 / 16))
    assert replace(interleaved, schedule="zero-bubble").bubble() == pytest.approx(7 / 71 / 3)

    layout = Layout(512, 8, 1, 64, 8, "none", staged)
    plan = make_plan(BIG, layout, Budget(10, 2048), MIXED, Hardware(), 4380)
    flat = make_plan(BIG, replace(layout, pipeline=Pipelining()), Budget(10, 2048), MIXED,
                     Hardware(), 4380)  # fmt: skip
    assert plan.bubble == pytest.approx(7 / 39)
    assert plan.step_s == pytest.approx(flat.step_s / (1 - 7 / 39))
    # Each of 32 micro-batches of one 4,096-token sequence: 8,192 channels / 8, 16-bit, there
    # and back.
    assert plan.pipeline_bytes_per_step == 2 * 2 * 4096 * 8192 * 2 / 8 * 32


def test_the_spec_and_the_planner_agree_on_the_bubble() -> None:
    for schedule, per_rank in (("1F1B", 1), ("interleaved-1F1B", 2), ("zero-bubble", 4)):
        parallel = ParallelSpec(pipeline=4, schedule=schedule, stages_per_rank=per_rank)
        for m in (1, 4, 16):
            ours = Pipelining(4, per_rank, m, schedule).bubble()
            assert parallel.bubble(m) == pytest.approx(ours)


def test_the_seed_job_is_proposed_a_layout_of_three_dimensions() -> None:
    """70 B parameters of 4,096-token sequences on 4,096 H100s: no layout of data parallelism
    alone fits; the best the estimate finds splits the model both ways."""
    proposals = propose(BIG, 4096, 8, Budget(10, 1024), MIXED, Hardware())
    assert proposals, "nothing fits"
    usable = 80 * GIB * Hardware().usable_memory_fraction
    assert all(c.memory_bytes <= usable for c in proposals)
    best = proposals[0]
    assert best.layout.pipeline.ranks > 1 and best.layout.tensor > 1
    assert [c.mfu for c in proposals] == sorted((c.mfu for c in proposals), reverse=True)
    assert 0.25 < best.mfu < Hardware().mfu
    # Each of its costs is a share of the step the estimate names.
    assert best.step_s == pytest.approx(
        best.compute_s / (1 - best.bubble) + best.tensor_s + best.data_exposed_s
    )
