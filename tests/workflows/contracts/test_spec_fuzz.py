"""Bad run specs and names, fuzzed: every one is refused with a message that names the field and
what is allowed, or is accepted with values the workflows can rely on; nothing else escapes."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from infra.store.protocol import validate_key
from tests.fuzz_strategies import (
    EXAMPLES,
    SPEC_EXAMPLES,
    Mutation,
    damaged_bytes,
    escaping_names,
    fuzz,
    mutated_specs,
    toml_document,
)
from worker.cli_common import CliError
from worker.cli_common import check_name as cli_check_name
from worker.specfile import SpecError, load_spec, parse_spec
from workflows.contracts.names import (
    NAME_RULE,
    InvalidName,
    check_name,
    check_snapshot_id,
    dataset_workflow_id,
    is_valid_name,
    standalone_dataset_workflow_id,
)
from workflows.contracts.spec import ResourcesSpec, RunSpec

# Words with which a message says what would be allowed instead.
ALLOWED_WORDS = ("should", "must", "use ", "required", "unknown key", "expected", "exceeds",
                 "not a value", "nested more", "cannot", "outside", "no such file",
                 "matches no files", "does not exist", "check data.sources", "make ",
                 "neither")  # fmt: skip


def check_refusal(message: str, changes: list[Mutation]) -> None:
    header, *lines = message.split("\n")
    assert header == "invalid run spec:", message
    assert lines, message
    for line in lines:
        # One problem per line, each starting with where ("train.steps: …", or a check across
        # tables that names its fields first) and short, whatever the input's size.
        assert line.startswith("  ") and re.split(r"[: ]", line[2:], maxsplit=1)[0], message
        assert len(line) < 600, line[:200]
        assert any(word in line for word in ALLOWED_WORDS), line
    # At least one change is named: by its dotted path, or (a check across fields) by the
    # field's name in its table's line.
    assert any(_names(message, change) for change in changes), (message, changes)


def _names(message: str, change: Mutation) -> bool:
    if change.dotted in message:
        return True
    table, _, field = change.dotted.rpartition(".")
    return any(field in line and (not table or table in line) for line in message.split("\n"))


def check_invariants(spec: RunSpec) -> None:
    """What the workflows take for granted once a spec is accepted."""
    for name in (spec.name, spec.owner, spec.resources.team, spec.model_name):
        assert is_valid_name(name), name
    world = spec.resources.world_size
    replicate, shard, tensor = spec.parallel.degrees(world)
    assert replicate * shard * tensor == world
    assert spec.train.batch_size % (replicate * shard * spec.train.grad_accum_steps) == 0
    assert spec.model.n_embd % spec.model.n_head == 0
    assert spec.model.n_head % tensor == 0 and spec.model.n_embd % tensor == 0
    assert spec.train.batch_size >= 1 and spec.train.steps >= 1
    assert spec.train.min_lr <= spec.train.learning_rate
    assert all(Path(s).is_absolute() and "\x00" not in s for s in spec.data.sources)
    _numbers_fit(spec.model_dump())
    # The wire: the spec goes through workflow histories as JSON and must come back equal,
    # far below Temporal's 2 MB payload limit.
    wire = spec.model_dump_json()
    assert RunSpec.model_validate_json(wire) == spec
    assert len(wire) < 1 << 20


def _numbers_fit(value: Any) -> None:
    if isinstance(value, dict):
        for item in value.values():
            _numbers_fit(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _numbers_fit(item)
    elif isinstance(value, float):
        assert math.isfinite(value), value
    elif isinstance(value, int) and not isinstance(value, bool):
        assert -(2**63) <= value < 2**63, value  # numpy, DuckDB, Parquet, Go: int64


@fuzz(400)
@given(mutated_specs())
@example(
    (
        {**tomllib.loads((EXAMPLES / "tiny.toml").read_text()), "train": {"grad_clip": math.inf}},
        [Mutation("value", ("train", "grad_clip"), math.inf)],
    )
)
def test_mutated_specs_are_refused_by_name_or_hold_their_invariants(
    mutated: tuple[dict, list[Mutation]],
) -> None:
    data, changes = mutated
    try:
        spec = parse_spec(data, EXAMPLES)
    except SpecError as err:
        event("refused")
        check_refusal(str(err), changes)
    else:
        event("accepted")
        check_invariants(spec)


@fuzz(150)
@given(st.sampled_from(SPEC_EXAMPLES).flatmap(lambda name: damaged_bytes(_example_bytes(name))))
def test_damaged_spec_files_are_refused_with_one_message(tmp_path: Path, raw: bytes) -> None:
    """Bytes flipped, cut or inserted anywhere in a spec file (bad UTF-8, broken TOML, stray
    keys): load_spec says so as a SpecError, or loads a spec that holds its invariants."""
    path = _spec_folder(tmp_path) / "spec.toml"
    path.write_bytes(raw)
    try:
        spec = load_spec(path)
    except SpecError as err:
        event("refused")
        message = str(err)
        assert message and all(len(line) < 2000 for line in message.split("\n")), message[:300]
    else:
        event("accepted")
        check_invariants(spec)


def _example_bytes(name: str) -> bytes:
    return (EXAMPLES / name).read_bytes()


def _spec_folder(folder: Path) -> Path:
    """A folder where the examples' relative source (data/tinyshakespeare.txt) exists."""
    corpus = folder / "data" / "tinyshakespeare.txt"
    if not corpus.exists():
        corpus.parent.mkdir(exist_ok=True)
        corpus.symlink_to(EXAMPLES / "data" / "tinyshakespeare.txt")
    return folder


@fuzz(100)
@given(mutated_specs(max_mutations=2))
def test_spec_files_written_by_hand_load_like_their_tables(
    tmp_path: Path, mutated: tuple[dict, list[Mutation]]
) -> None:
    """The same mutations through a TOML file: the file adds only its own ways to fail."""
    data, changes = mutated
    path = _spec_folder(tmp_path) / "spec.toml"
    path.write_text(toml_document(data), encoding="utf-8")
    try:
        spec = load_spec(path)
    except SpecError as err:
        event("refused")
        message = str(err)
        if message.startswith("invalid run spec:"):  # else the file's own TOML is named
            check_refusal(message, changes)
    else:
        event("accepted")
        check_invariants(spec)


def test_a_spec_with_inf_is_refused_before_it_reaches_the_wire() -> None:
    """JSON has no inf: the converter writes null, and the run could not read its own spec."""
    data = {**tomllib.loads((EXAMPLES / "tiny.toml").read_text())}
    data["train"] = {**data["train"], "grad_clip": math.inf}
    try:
        parse_spec(data, EXAMPLES)
    except SpecError as err:
        assert "train.grad_clip: Input should be a finite number" in str(err)
    else:
        raise AssertionError("inf accepted")


def test_strict_types_refuse_what_lax_validation_coerced() -> None:
    base = tomllib.loads((EXAMPLES / "tiny.toml").read_text())
    coerced = [("train", "steps", True), ("train", "steps", "60"),
               ("resources", "preemptible", "no"), ("model", "rope", 1)]  # fmt: skip
    for section, key, value in coerced:
        data = {**base, section: {**base.get(section, {}), key: value}}
        try:
            parse_spec(data, EXAMPLES)
        except SpecError as err:
            assert f"{section}.{key}: Input should be a valid" in str(err), str(err)
        else:
            raise AssertionError(f"{section}.{key} = {value!r} accepted")


def test_a_folder_or_glob_source_loads_and_an_empty_one_is_named(tmp_path: Path) -> None:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello there\n")
    (tmp_path / "empty").mkdir()
    spec_file = tmp_path / "spec.toml"
    spec_file.write_text('name = "r1"\n[data]\nsources = ["corpus", "corpus/*.txt"]\n')
    assert load_spec(spec_file).data.sources == [
        str(tmp_path / "corpus"),
        str(tmp_path / "corpus" / "*.txt"),
    ]
    spec_file.write_text('name = "r1"\n[data]\nsources = ["empty"]\n')
    try:
        load_spec(spec_file)
    except SpecError as err:
        assert f"data.sources: source pattern {tmp_path / 'empty'} matches no files" in str(err)
    else:
        raise AssertionError("an empty folder accepted")


# --- names ----------------------------------------------------------------------------------


@fuzz(300)
@given(escaping_names())
@example("run\n")  # re.match's '$' matched before a final newline: accepted until fixed
@example("..")
@example("a" * 63)
def test_names_are_safe_everywhere_or_refused_in_one_line(tmp_path: Path, name: str) -> None:
    pydantic_accepts = _pydantic_accepts(name)
    try:
        checked = check_name(name, "run name")
    except InvalidName as err:
        event("refused")
        message = str(err)
        assert "\n" not in message and len(message) < 300, message
        assert message.startswith("run name ") and NAME_RULE in message
        assert not pydantic_accepts  # the CLI's check and the spec's agree
        try:
            cli_check_name(name)
        except CliError as cli_err:
            assert str(cli_err) == message
        else:
            raise AssertionError("the CLI accepted a name the rule refuses") from None
        return
    event("accepted")
    assert checked == name and pydantic_accepts
    # Every place a name goes stays where it belongs.
    assert Path(name).parts == (name,) and name not in (".", "..")
    validate_key(f"runs/{name}/checkpoints/step-1/MANIFEST.json")
    validate_key(f"datasets/{name}/MANIFEST.json")
    for root in (tmp_path / "runs", tmp_path / "nodes", tmp_path / "reports"):
        assert (root / name).resolve().parent == root.resolve()
    assert len(dataset_workflow_id(name).encode()) <= 255
    assert name == name.strip() and name.isascii() and name.lower() == name


def _pydantic_accepts(name: str) -> bool:
    try:
        ResourcesSpec(team=name)
    except ValidationError:
        return False
    return True


@fuzz(200)
@given(st.one_of(escaping_names(), st.from_regex(r"[0-9a-f]{6,70}", fullmatch=True)))
@example("0123456789abcdef0123\n")
def test_snapshot_ids_are_hex_or_refused(snapshot_id: str) -> None:
    try:
        checked = check_snapshot_id(snapshot_id)
    except InvalidName as err:
        event("refused")
        assert "\n" not in str(err) and "hex digits" in str(err)
        return
    event("accepted")
    assert checked.isalnum() and set(checked) <= set("0123456789abcdef")
    validate_key(f"datasets/{checked}/MANIFEST.json")
    assert json.dumps(checked) == f'"{checked}"'


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("forgeline-cluster", "the Cluster workflow's id"),
        ("tiny-dataset", "a run's data preparation"),
        (standalone_dataset_workflow_id("0123456789abcdef" * 4), "`forgeline data prepare`"),
    ],
)
def test_a_run_may_not_take_another_workflow_s_id(name: str, why: str) -> None:
    """Before, `tiny-dataset` started as a run and the run `tiny` then met it as its own data
    preparation; `forgeline-cluster` attached to the Cluster workflow."""
    with pytest.raises(ValidationError) as refused:
        RunSpec.model_validate({"name": name, "data": {"sources": ["/dev/null"]}})
    (error,) = refused.value.errors()
    assert error["loc"] == ("name",) and why in error["msg"], error
    RunSpec.model_validate({"name": "dataset-tiny", "data": {"sources": ["/dev/null"]}})
