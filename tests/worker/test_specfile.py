import re
from pathlib import Path

import pytest

from infra.processes import free_port
from tests.conftest import REPO
from worker.run_actions import RunActionError, _on_nodes
from worker.specfile import SpecError, load_spec, parse_spec, spec_sha256

VALID = {"name": "r1", "data": {"sources": ["corpus.txt"]}}


@pytest.mark.parametrize(
    "example",
    [
        "tiny.toml",
        "tiny-fsdp.toml",
        "shakespeare-char.toml",
        "byo/gru.toml",
        "byo/convnet.toml",
        "byo/staged.toml",
    ],
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
        ({"parallel": {"stages": 2}}, "parallel.stages: unknown key"),
        (
            {"resources": {"nodes": 3}, "parallel": {"pipeline": 3}},
            "model.n_layer (4) must be a multiple of the pipeline's stages, parallel.pipeline (3) "
            "× stages_per_rank (1) = 3",
        ),
        (
            {
                "resources": {"nodes": 2},
                "parallel": {"pipeline": 2, "schedule": "zero-bubble"},
                "model": {"n_layer": 6},
            },
            "model.n_layer (6) must be a multiple of the pipeline's stages, parallel.pipeline (2) "
            "× stages_per_rank (2) = 4",
        ),
        (
            {"resources": {"nodes": 4}, "parallel": {"pipeline": 4}, "train": {"batch_size": 2}},
            "parallel.microbatches (2) is fewer than the pipeline's stages (4): 1F1B needs",
        ),
        (
            {"resources": {"nodes": 2}, "parallel": {"pipeline": 2, "microbatches": 3}},
            "parallel.microbatches (3) must divide each data-parallel rank's batch",
        ),
        (
            {"resources": {"nodes": 2}, "parallel": {"pipeline": 2, "stages_per_rank": 2}},
            "parallel.stages_per_rank (2) needs an interleaved schedule",
        ),
        (
            {
                "resources": {"nodes": 2},
                "parallel": {"pipeline": 2},
                "train": {"grad_accum_steps": 2},
            },
            "train.grad_accum_steps (2) under a pipeline: its micro-batches are the accumulation",
        ),
        (
            {
                "resources": {"nodes": 4},
                "parallel": {"pipeline": 2},
                "recovery": {"shadow_every": 5},
            },
            "recovery.shadow_every (5) recomputes a whole micro-batch on one rank",
        ),
        ({"parallel": {"microbatches": 4}}, "and parallel.pipeline is 1"),
        (
            {"resources": {"nodes": 4, "min_nodes": 2}, "parallel": {"pipeline": 2}},
            "a pipeline's stages cannot shrink",
        ),
        (
            {"resources": {"nodes": 2}, "model": {"n_layer": 3}, "parallel": {"pipeline": 3}},
            "parallel.pipeline (3) × parallel.replicate (1) × parallel.shard (1) × "
            "parallel.tensor (1) = 3, but the gang has",
        ),
        (
            {"parallel": {"activation_checkpointing": "some"}},
            "parallel.activation_checkpointing: Input should be 'none', 'full' or 'selective'",
        ),
        (
            {
                "train": {"code": "src", "entrypoint": "t.py", "checkpoints": "folder"},
                "parallel": {"activation_checkpointing": "full"},
            },
            'parallel.activation_checkpointing = "full" is applied by the SDK',
        ),
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
        (
            {"train": {"checkpoint_every": 50, "peer_every": 50}},
            "peer_every (50) must be below checkpoint_every (50)",
        ),
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
                   "runs/r0/checkpoints/step-40/gen-2/MANIFEST.json",
                   "runs/r0/checkpoints/step-40/MANIFEST.json"):  # the former layout  # fmt: skip
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


# --- s3:// and store: sources (listed against moto over HTTP) ------------------------------


def _spec_file(tmp_path: Path, *sources: str) -> Path:
    spec_file = tmp_path / "spec.toml"
    listed = ", ".join(f'"{s}"' for s in sources)
    spec_file.write_text(f'name = "r1"\n[data]\nsources = [{listed}]\n')
    return spec_file


def _refusal(spec_file: Path) -> str:
    with pytest.raises(SpecError) as raised:
        load_spec(spec_file)
    message = str(raised.value)
    assert message.count("\n") == 1 and "Traceback" not in message  # one line under the header
    return message.splitlines()[1]


def test_object_sources_are_neither_resolved_nor_looked_for_on_disk(
    tmp_path: Path, raw, bucket: str
) -> None:
    raw.put_object(Bucket=bucket, Key="corpus/a.txt", Body=b"alpha")
    (tmp_path / "b.txt").write_text("beta")
    url = f"s3://{bucket}/corpus/"
    spec = load_spec(_spec_file(tmp_path, url, "b.txt"))
    assert spec.data.sources == [url, str(tmp_path / "b.txt")]
    assert parse_spec({**VALID, "data": {"sources": ["store:corpus/"]}}, tmp_path).data.sources == [
        "store:corpus/"
    ]


def test_an_empty_prefix_is_refused_with_its_url(tmp_path: Path, raw, bucket: str) -> None:
    raw.put_object(Bucket=bucket, Key="elsewhere/a.txt", Body=b"alpha")
    line = _refusal(_spec_file(tmp_path, f"s3://{bucket}/corpus/"))
    assert line == (
        f"  data.sources: source pattern s3://{bucket}/corpus/ matches no objects: "
        "check data.sources"
    )


def test_a_bucket_missing_or_out_of_reach_is_one_line(tmp_path: Path, endpoint: str) -> None:
    line = _refusal(_spec_file(tmp_path, "s3://forgeline-nowhere/corpus/"))
    assert "s3://forgeline-nowhere/corpus/ cannot be listed" in line and "does not exist" in line
    closed = f"http://127.0.0.1:{free_port()}"
    line = _refusal(_spec_file(tmp_path, f"s3://forgeline-x/corpus/?endpoint={closed}"))
    assert f"cannot reach the S3 endpoint {closed} for s3://forgeline-x/corpus/" in line


def test_credentials_in_a_source_url_are_refused_and_not_repeated(tmp_path: Path) -> None:
    line = _refusal(_spec_file(tmp_path, "s3://AKIAEXAMPLE:hunter2-secret-key@bucket/corpus/"))
    assert "hunter2-secret-key" not in line
    assert line.startswith(
        "  data.sources: source s3://AKIAEXAMPLE:***@bucket/corpus/ carries credentials: "
        "remove them from the URL in data.sources"
    )
    assert "put them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in line


def test_store_sources_are_listed_in_the_configured_store(
    tmp_path: Path, raw, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORGELINE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORGELINE_STORE", f"s3://{bucket}/store")
    monkeypatch.delenv("FORGELINE_TWIN_STORE", raising=False)
    raw.put_object(Bucket=bucket, Key="store/corpus/a.jsonl", Body=b'{"text": "alpha"}\n')
    assert load_spec(_spec_file(tmp_path, "store:corpus/")).data.sources == ["store:corpus/"]
    line = _refusal(_spec_file(tmp_path, "store:web/*.jsonl"))
    assert line == (
        f"  data.sources: store:web/*.jsonl (in the store s3://{bucket}/store): source pattern "
        f"s3://{bucket}/store/web/*.jsonl matches no objects: check data.sources"
    )


@pytest.mark.parametrize(
    ("resources", "batch_size", "message"),
    [
        ({"nodes": 2, "min_nodes": 3}, 12, "resources: min_nodes (3) must be at most nodes (2)"),
        (
            {"nodes": 4, "min_nodes": 2},
            20,
            "resources.min_nodes (2): on 3 node(s) train.batch_size (20) cannot be split evenly "
            "over 3 data-parallel ranks",
        ),
    ],
)
def test_an_elastic_run_must_lay_out_at_every_size_it_may_shrink_to(
    tmp_path: Path, resources: dict, batch_size: int, message: str
) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        parse_spec({**VALID, "resources": resources, "train": {"batch_size": batch_size}}, tmp_path)


def test_a_shrunk_gang_keeps_the_global_batch_and_no_larger_micro_batches(tmp_path: Path) -> None:
    spec = parse_spec(
        {**VALID, "resources": {"nodes": 4, "min_nodes": 1}, "train": {"batch_size": 12}}, tmp_path
    )
    assert spec.on_nodes(4) is spec
    laid_out = {n: spec.on_nodes(n) for n in (1, 2, 3)}
    assert {n: s.train.grad_accum_steps for n, s in laid_out.items()} == {1: 4, 2: 2, 3: 2}
    for nodes, shrunk in laid_out.items():
        assert shrunk.resources.nodes == nodes and shrunk.train.batch_size == 12
        assert 12 // (nodes * shrunk.train.grad_accum_steps) <= 12 // 4


def test_resume_on_fewer_nodes_keeps_an_elastic_floor_within_them(tmp_path: Path) -> None:
    elastic = parse_spec(
        {**VALID, "resources": {"nodes": 4, "min_nodes": 3}, "train": {"batch_size": 12}}, tmp_path
    )
    assert _on_nodes(2, elastic).resources.model_dump(include={"nodes", "min_nodes"}) == {
        "nodes": 2,
        "min_nodes": 2,
    }
    assert _on_nodes(3, elastic).resources.min_nodes == 3
    # More nodes than before: every size down to the floor must still lay out.
    with pytest.raises(RunActionError, match=r"(?s)--nodes 6: .*min_nodes \(3\): on 5 node"):
        _on_nodes(6, elastic)
