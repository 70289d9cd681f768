import os
import re
from pathlib import Path

import pytest

from dataprep.errors import SourceError
from dataprep.sources import SourceFile, classify, expand_sources, known_extensions


def touch(root: Path, *names: str) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")


def rel(root: Path, sources: list[SourceFile]) -> list[str]:
    return [os.path.relpath(s.path, root) for s in sources]


def test_formats_and_languages_by_extension() -> None:
    assert classify("/d/a.txt") == SourceFile("/d/a.txt", "text")
    assert classify("/d/README.MD") == SourceFile("/d/README.MD", "text")
    assert classify("/d/a.rst").format == "text"  # type: ignore[union-attr]
    for name in ("a.jsonl", "a.json", "a.ndjson", "a.jsonl.gz", "a.json.gz", "a.NDJSON.GZ"):
        assert classify(f"/d/{name}") == SourceFile(f"/d/{name}", "jsonl"), name
    assert classify("/d/a.parquet") == SourceFile("/d/a.parquet", "parquet")
    languages = {
        "py": "python",
        "pyi": "python",
        "c": "c",
        "h": "c",
        "cc": "cpp",
        "cpp": "cpp",
        "hpp": "cpp",
        "java": "java",
        "js": "javascript",
        "ts": "typescript",
        "go": "go",
        "rs": "rust",
        "rb": "ruby",
        "sh": "shell",
        "sql": "sql",
        "scala": "scala",
        "kt": "kotlin",
        "swift": "swift",
        "php": "php",
        "cs": "csharp",
        "lua": "lua",
        "pl": "perl",
        "r": "r",
        "jl": "julia",
        "hs": "haskell",
        "ml": "ocaml",
        "toml": "toml",
        "yaml": "yaml",
        "yml": "yaml",
    }
    for ext, language in languages.items():
        assert classify(f"/d/f.{ext}") == SourceFile(f"/d/f.{ext}", "code", language), ext
    for name in ("a.csv", "a.txt.gz", "Makefile", ".bashrc", "a.gz", "a."):
        assert classify(f"/d/{name}") is None, name


def test_directory_is_walked_skipping_hidden_tool_folders_and_unknown_files(
    tmp_path: Path,
) -> None:
    touch(
        tmp_path,
        "b.txt",
        "a/x.py",
        "a/deep/er/y.jsonl.gz",
        "a/notes.csv",
        ".hidden.txt",
        ".git/config.toml",
        "pkg/__pycache__/m.py",
        "web/node_modules/lib/index.js",
        "web/app.ts",
    )
    sources = expand_sources([str(tmp_path)])
    assert rel(tmp_path, sources) == ["a/deep/er/y.jsonl.gz", "a/x.py", "b.txt", "web/app.ts"]
    assert [(s.format, s.language) for s in sources] == [
        ("jsonl", None),
        ("code", "python"),
        ("text", None),
        ("code", "typescript"),
    ]
    assert all(os.path.isabs(s.path) for s in sources)


def test_globs_match_components_and_double_star_recurses(tmp_path: Path) -> None:
    touch(tmp_path, "a.txt", "b.txt", "c.md", "sub/d.txt", "sub/more/e.txt", ".h/f.txt", "g.csv")
    root = str(tmp_path)
    assert rel(tmp_path, expand_sources([f"{root}/*.txt"])) == ["a.txt", "b.txt"]
    assert rel(tmp_path, expand_sources([f"{root}/?.md"])) == ["c.md"]
    assert rel(tmp_path, expand_sources([f"{root}/[ac].*"])) == ["a.txt", "c.md"]
    assert rel(tmp_path, expand_sources([f"{root}/**/*.txt"])) == [
        "a.txt",
        "b.txt",
        "sub/d.txt",
        "sub/more/e.txt",
    ]
    assert rel(tmp_path, expand_sources([f"{root}/sub/**"])) == ["sub/d.txt", "sub/more/e.txt"]
    # A wildcard that matches a folder takes everything below it, like naming the folder.
    assert rel(tmp_path, expand_sources([f"{root}/s*"])) == ["sub/d.txt", "sub/more/e.txt"]
    # Hidden entries match only a pattern that names them with a leading dot.
    assert rel(tmp_path, expand_sources([f"{root}/.*/*.txt"])) == [".h/f.txt"]


def test_result_is_deduplicated_and_sorted_whatever_the_pattern_order(tmp_path: Path) -> None:
    touch(tmp_path, "z.txt", "m/a.py", "m/b.py", "a.jsonl")
    root = str(tmp_path)
    one = expand_sources([f"{root}/m", f"{root}/z.txt", f"{root}/**/*.py", root])
    two = expand_sources([root, f"{root}/m/b.py"])
    assert one == two
    assert rel(tmp_path, one) == ["a.jsonl", "m/a.py", "m/b.py", "z.txt"]
    assert [s.path for s in one] == sorted(s.path for s in one)


def test_explicit_file_with_unknown_extension_is_an_error(tmp_path: Path) -> None:
    touch(tmp_path, "table.csv")
    with pytest.raises(SourceError, match=r"table\.csv has an unknown extension") as err:
        expand_sources([str(tmp_path / "table.csv")])
    assert ".jsonl.gz" in str(err.value) and ".txt" in str(err.value)


def test_patterns_matching_nothing_are_errors_naming_the_pattern(tmp_path: Path) -> None:
    touch(tmp_path, "only.csv", "a.txt")
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(SourceError, match=f"source {missing} does not exist"):
        expand_sources([missing])
    pattern = str(tmp_path / "*.jsonl")
    with pytest.raises(SourceError, match=re.escape(f"pattern {pattern} matches no files")):
        expand_sources([str(tmp_path / "a.txt"), pattern])
    (tmp_path / "csvs").mkdir()
    touch(tmp_path / "csvs", "x.csv")
    with pytest.raises(SourceError, match=r"1 files with unknown extensions were skipped, e\.g\."):
        expand_sources([str(tmp_path / "csvs")])
    with pytest.raises(SourceError, match="is not an absolute path"):
        expand_sources(["data/*.txt"])


def test_file_symlinks_are_followed_and_folder_symlinks_are_not(tmp_path: Path) -> None:
    touch(tmp_path, "tree/a.txt", "elsewhere/b.txt")
    (tmp_path / "tree" / "link.txt").symlink_to(tmp_path / "elsewhere" / "b.txt")
    (tmp_path / "tree" / "loop").symlink_to(tmp_path / "tree")  # a cycle if followed
    (tmp_path / "tree" / "broken.txt").symlink_to(tmp_path / "nowhere.txt")
    tree = tmp_path / "tree"
    assert rel(tree, expand_sources([str(tree)])) == ["a.txt", "link.txt"]
    assert rel(tree, expand_sources([f"{tree}/**/*.txt"])) == ["a.txt", "link.txt"]


def test_an_existing_name_with_glob_characters_is_taken_literally(tmp_path: Path) -> None:
    touch(tmp_path, "a[1].txt", "a1.txt")
    assert rel(tmp_path, expand_sources([str(tmp_path / "a[1].txt")])) == ["a[1].txt"]


def test_known_extensions_are_listed_once() -> None:
    names = known_extensions()
    assert len(names) == len(set(names))
    assert {".txt", ".jsonl.gz", ".parquet", ".py", ".yml"} <= set(names)
