from pathlib import Path

import pytest

from tests.conftest import REPO
from worker.specfile import SpecError, load_spec, parse_spec, spec_sha256

VALID = {"name": "r1", "data": {"sources": ["corpus.txt"]}}


@pytest.mark.parametrize(
    "example",
    ["tiny.toml", "tiny-fsdp.toml", "shakespeare-char.toml", "byo/gru.toml", "byo/convnet.toml"],
)
def test_examples_are_valid(example: str) -> None:
    spec = load_spec(REPO / "examples" / example)
    assert Path(spec.data.sources[0]).is_file()
    assert spec.train.batch_size % spec.resources.world_size == 0


def test_sources_resolve_against_the_spec_folder(tmp_path: Path) -> None:
    spec = parse_spec(VALID, tmp_path)
    assert spec.data.sources == [str(tmp_path / "corpus.txt")]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"name": "../etc"}, "name: '../etc' is not a valid name"),
        ({"name": "Has Space"}, "name: 'Has Space' is not a valid name"),
        ({"steps": 5}, "steps: unknown key"),
        ({"train": {"steps": 0}}, "train.steps: Input should be greater than or equal to 1"),
        ({"train": {"steps": "many"}}, "train.steps: Input should be a valid integer"),
        (
            {"train": {"batch_size": 3}, "resources": {"nodes": 2}},
            "train.batch_size (3) must be a multiple of the data-parallel ranks (2)",
        ),
        (
            {"train": {"batch_size": 8, "grad_accum_steps": 3}},
            "× train.grad_accum_steps (3) = 3",
        ),
        (
            {"resources": {"nodes": 2, "gpus_per_node": 2}, "parallel": {"shard": 3}},
            "parallel.replicate (1) × parallel.shard (3) × parallel.tensor (1) = 3, but the gang "
            "has resources.nodes × resources.gpus_per_node = 4 ranks",
        ),
        (
            {"resources": {"nodes": 2}, "parallel": {"replicate": 1}},
            "= 1, but the gang has resources.nodes × resources.gpus_per_node = 2 ranks",
        ),
        (
            {"resources": {"nodes": 3}, "parallel": {"tensor": 3}},
            "model.n_head (4) must be a multiple of parallel.tensor (3)",
        ),
        ({"parallel": {"pipeline": 2}}, "parallel.pipeline: unknown key"),
        ({"model": {"rope": True, "n_embd": 12, "n_head": 4}}, "rope needs an even head size"),
        ({"model": {"init_from": "../../etc/passwd"}}, "init_from '../../etc/passwd' is neither"),
        ({"model": {"n_embd": 100, "n_head": 3}}, "n_embd (100) must be a multiple of n_head (3)"),
        ({"data": {"sources": []}}, "data.sources: List should have at least 1 item"),
        ({"data": {"sources": ["x"], "tokenizer": "wordpiece"}}, "data.tokenizer: Input should be"),
        (
            {"data": {"sources": ["x"], "filters": {"min_word": 3}}},
            "data.filters.min_word: unknown key",
        ),
        (
            {"data": {"sources": ["x"], "filters": {"min_words": 60, "max_words": 50}}},
            "min_words (60) exceeds max_words (50)",
        ),
        (
            {"data": {"sources": ["x"], "dedup": {"memory_limit": "lots"}}},
            "data.dedup.memory_limit: 'lots' is not valid: expected a size such as 512MB or 2GB",
        ),
        (
            {"data": {"sources": ["x"], "filters": {"max_top_ngram_char_fraction": [[2, 1.5]]}}},
            "data.filters.max_top_ngram_char_fraction.0.1: Input should be less than or equal to 1",
        ),
        ({"train": {"learning_rate": 1e-4, "min_lr": 1e-3}}, "min_lr (0.001) must not exceed"),
        ({"train": {"entrypoint": "train.py"}}, "train.code and train.entrypoint go together"),
        ({"train": {"code": "src"}}, "train.code and train.entrypoint go together"),
        (
            {"train": {"code": "src", "entrypoint": "train.sh"}},
            "train.entrypoint 'train.sh' is neither a .py file inside train.code",
        ),
        (
            {"train": {"code": "src", "entrypoint": "../train.py"}},
            "train.entrypoint '../train.py' is neither",
        ),
        (
            {"train": {"code": "src", "entrypoint": "a/../../train.py"}},
            "train.entrypoint 'a/../../train.py' is neither",
        ),
        (
            {"train": {"code": "src", "entrypoint": "t.py", "args": {"blob": "x" * 70_000}}},
            "train.args is 70012 bytes as JSON, over 65536: pass a file in train.code instead",
        ),
    ],
)
def test_bad_specs_name_the_field(tmp_path: Path, patch: dict, message: str) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec({**VALID, **patch}, tmp_path)
    assert message in str(raised.value)


def test_missing_name_and_data(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec({}, tmp_path)
    assert "name: required but missing" in str(raised.value)
    assert "data: required but missing" in str(raised.value)


def test_missing_source_file_is_rejected_before_submission(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.toml"
    spec_file.write_text('name = "r1"\n[data]\nsources = ["nope.txt"]\n')
    with pytest.raises(SpecError, match=r"data\.sources: no such file: .*nope\.txt"):
        load_spec(spec_file)


def test_invalid_toml(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.toml"
    spec_file.write_text("name = \n")
    with pytest.raises(SpecError, match="is not valid TOML"):
        load_spec(spec_file)


def test_spec_hash_changes_with_any_field(tmp_path: Path) -> None:
    a = parse_spec(VALID, tmp_path)
    b = parse_spec({**VALID, "train": {"steps": 7}}, tmp_path)
    assert spec_sha256(a) == spec_sha256(parse_spec(VALID, tmp_path))
    assert spec_sha256(a) != spec_sha256(b)


@pytest.mark.parametrize(
    ("resources", "parallel", "degrees"),
    [
        ({"nodes": 2, "gpus_per_node": 2}, {}, (4, 1, 1)),
        ({"nodes": 2, "gpus_per_node": 2}, {"shard": 2}, (2, 2, 1)),
        ({"nodes": 2, "gpus_per_node": 2}, {"shard": 2, "tensor": 2}, (1, 2, 2)),
        ({"nodes": 1, "gpus_per_node": 2}, {"tensor": 2}, (1, 1, 2)),
    ],
)
def test_layouts_fill_the_gang(
    tmp_path: Path, resources: dict, parallel: dict, degrees: tuple
) -> None:
    spec = parse_spec({**VALID, "resources": resources, "parallel": parallel}, tmp_path)
    assert spec.parallel.degrees(spec.resources.world_size) == degrees


def test_init_from_accepts_registered_models_and_manifests(tmp_path: Path) -> None:
    for source in ("models:/tiny/3", "models:/tiny@production",
                   "runs/r0/checkpoints/step-40/MANIFEST.json"):  # fmt: skip
        assert parse_spec({**VALID, "model": {"init_from": source}}, tmp_path)


def test_user_code_resolves_against_the_spec_folder_and_must_exist(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text("text\n")
    (tmp_path / "src").mkdir()
    spec_file = tmp_path / "spec.toml"
    body = 'name = "r1"\n[data]\nsources = ["corpus.txt"]\n[train]\ncode = "src"\n'
    spec_file.write_text(body + 'entrypoint = "train.py"\n[train.args]\nwidth = 8\n')
    with pytest.raises(SpecError, match=r"train\.entrypoint: no file 'train\.py' in train\.code"):
        load_spec(spec_file)
    (tmp_path / "src" / "train.py").write_text("")
    spec = load_spec(spec_file)
    assert (spec.train.code, spec.train.args) == (str(tmp_path / "src"), {"width": 8})
    spec_file.write_text(body.replace('"src"', '"gone"') + 'entrypoint = "pkg.main:run"\n')
    with pytest.raises(SpecError, match=r"train\.code: no such folder: .*gone"):
        load_spec(spec_file)
