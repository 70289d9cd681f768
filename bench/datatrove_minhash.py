"""HuggingFace datatrove's MinHash dedup, run as the baseline on a :mod:`bench.corpus` corpus.

The four datatrove stages run with ``LocalPipelineExecutor`` in a fresh Python subprocess, so
the timing and peak RSS cover datatrove alone (not the parent holding the corpus):

1. ``JsonlReader`` → id recorder → ``MinhashDedupSignature``   (tasks = workers = ``workers``)
2. ``MinhashDedupBuckets``                                      (tasks = num_buckets)
3. ``MinhashDedupCluster(save_cluster_id=True)``                (one task: datatrove requires it)
4. ``JsonlReader`` → ``MinhashDedupFilter`` with an exclusion writer (tasks = ``workers``)

Datatrove names documents by (input rank, index in that rank's document stream). The id
recorder sits right before ``MinhashDedupSignature`` and writes the ``doc_id`` of every
document it passes, in order, so ``.clusters``/``.remove`` entries map back to our ids exactly.
The filter stage's exclusion writer gives the removed ids a second, independent way, and the
two must agree.

Tokenizer: ``language="eng"`` maps to ``SpaCyTokenizer("en")``, i.e. ``spacy.blank("en")``:
rules shipped inside the spaCy wheel, no model download (so it works offline). Before
tokenizing, datatrove's ``simplify_text`` lowercases, maps numbers to ``0``, turns punctuation
into spaces and strips diacritics, so its shingles are not ours (documents under 5 tokens get
no signature at all and are never matched).

Requirements: the ``bench`` extra of pyproject.toml (datatrove, xxhash, spacy, orjson, regex).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.corpus import BenchDoc, write_jsonl

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BaselineResult:
    seconds: float  # wall time of all four stages, excluding corpus writing and interpreter start
    clusters: dict[int, int]  # doc_id -> cluster id, for every doc in a duplicate cluster
    removed: set[int]  # doc_ids datatrove removes
    peak_rss_mb: float  # peak summed RSS of the datatrove process tree (PSS in params)
    # Additions to the brief: per-stage wall times and the datatrove settings actually used.
    stage_seconds: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Pipeline pieces. Module-level so datatrove's (dill) pickling sends them by reference.


def _reader_adapter(self: Any, data: dict, path: str, id_in_file: int | str) -> dict:
    # Keep our integer id in metadata (Document.id must be a string).
    return {
        "text": data["text"],
        "id": str(data["id"]),
        "metadata": {"doc_id": data["id"], "origin": data["origin"]},
    }


def _removed_record(self: Any, document: Any) -> dict:
    return {"doc_id": document.metadata["doc_id"]}


def _record_ids(folder: str, data: Iterator[Any], rank: int = 0, world_size: int = 1) -> Iterator:
    """Pass documents through, writing their doc_ids in stream order to ``folder/{rank}.ids``."""
    ids: list[int] = []
    for doc in data:
        ids.append(doc.metadata["doc_id"])
        yield doc
    Path(folder).mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype="<i8").tofile(Path(folder) / f"{rank:05d}.ids")


def _drain(data: Iterator[Any], rank: int = 0, world_size: int = 1) -> None:
    # The executor drains the last step itself; an explicit sink keeps kept docs unwritten.
    for _ in data:
        pass


def _minhash_config(n_grams: int, buckets: int, hashes_per_bucket: int) -> Any:
    from datatrove.pipeline.dedup.minhash import MinhashConfig

    return MinhashConfig(n_grams=n_grams, num_buckets=buckets, hashes_per_bucket=hashes_per_bucket)


def _describe_config(cfg: Any, workers: int) -> dict[str, Any]:
    import dataclasses

    import datatrove
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    tok = load_word_tokenizer("eng")
    return {
        "datatrove": getattr(datatrove, "__version__", None) or _dist_version("datatrove"),
        "n_grams": cfg.n_grams,
        "num_buckets": cfg.num_buckets,
        "hashes_per_bucket": cfg.hashes_per_bucket,
        "seed": cfg.seed,
        "hash_precision": cfg.hash_config.precision,
        "hash_fc": cfg.hash_config.hash_fc,
        "norm_config": dataclasses.asdict(cfg.norm_config),
        "language": "eng",
        "tokenizer": f"{type(tok).__name__}({getattr(tok, 'language', None)!r})",
        "workers": workers,
        "start_method": "forkserver",
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _child_main(config_path: str) -> None:
    """Runs in the subprocess: the four datatrove stages, then writes ``result.json``."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    cfg_in = json.loads(Path(config_path).read_text())
    work = Path(cfg_in["workdir"])
    dt = work / "dt"
    workers = cfg_in["workers"]
    cfg = _minhash_config(cfg_in["n_grams"], cfg_in["buckets"], cfg_in["hashes_per_bucket"])

    def reader() -> JsonlReader:
        return JsonlReader(str(work / "input"), adapter=_reader_adapter, compression=None)

    stages = {
        "signatures": LocalPipelineExecutor(
            [
                reader(),
                partial(_record_ids, str(dt / "ids")),
                MinhashDedupSignature(output_folder=str(dt / "signatures"), config=cfg),
            ],
            tasks=workers,
            workers=workers,
            logging_dir=str(dt / "logs" / "signatures"),
        ),
        # MinhashDedupBuckets asserts tasks % num_buckets == 0: one task per bucket.
        "buckets": LocalPipelineExecutor(
            [
                MinhashDedupBuckets(
                    input_folder=str(dt / "signatures"),
                    output_folder=str(dt / "buckets"),
                    config=cfg,
                )
            ],
            tasks=cfg.num_buckets,
            workers=workers,
            logging_dir=str(dt / "logs" / "buckets"),
        ),
        # MinhashDedupCluster asserts world_size == 1.
        "cluster": LocalPipelineExecutor(
            [
                MinhashDedupCluster(
                    input_folder=str(dt / "buckets"),
                    output_folder=str(dt / "remove_ids"),
                    config=cfg,
                    save_cluster_id=True,
                )
            ],
            tasks=1,
            workers=1,
            logging_dir=str(dt / "logs" / "cluster"),
        ),
        "filter": LocalPipelineExecutor(
            [
                reader(),
                MinhashDedupFilter(
                    input_folder=str(dt / "remove_ids"),
                    exclusion_writer=JsonlWriter(
                        str(dt / "removed"),
                        output_filename="${rank}.jsonl",
                        compression=None,
                        adapter=_removed_record,
                    ),
                ),
                _drain,
            ],
            tasks=workers,
            workers=workers,
            logging_dir=str(dt / "logs" / "filter"),
        ),
    }
    stage_seconds: dict[str, float] = {}
    start = time.perf_counter()
    for name, executor in stages.items():
        t0 = time.perf_counter()
        executor.run()
        stage_seconds[name] = time.perf_counter() - t0
    seconds = time.perf_counter() - start

    result = {
        "seconds": seconds,
        "stage_seconds": stage_seconds,
        # ru_maxrss is in KiB on Linux; CHILDREN is the largest single reaped child.
        "maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "maxrss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "params": _describe_config(cfg, workers),
    }
    (work / "result.json").write_text(json.dumps(result, indent=2))


# ---------------------------------------------------------------------------------------------
# Parent side


class TreeMemorySampler:
    """Samples the summed memory of a process and all its descendants from /proc.

    ``peak_rss_bytes`` sums RSS, so pages shared between forked workers and loaded libraries
    count once per process (an upper bound); ``peak_pss_bytes`` sums PSS (shared pages split
    between their users), the better estimate of what the tree really holds. Datatrove's pool
    workers are children of its forkserver, not of the process that waits for them, so
    ``RUSAGE_CHILDREN`` misses them: sampling the tree is what sees them.
    """

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid = pid
        self.interval = interval
        self.peak_rss_bytes = 0
        self.peak_pss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> TreeMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            # The command name may contain spaces and parens: the ppid follows the last ')'.
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
        tree, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(children.get(pid, []))
        return tree

    def _sample(self) -> tuple[int, int]:
        rss = pss = 0
        for pid in self._tree():
            try:
                rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * self._page
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                        break
            except (OSError, IndexError, ValueError):
                continue  # the process ended between listing and reading
        return rss, pss

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = self._sample()
            self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            self._stop.wait(self.interval)


def _read_u32(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<u4")


def _collect(work: Path) -> tuple[dict[int, int], set[int]]:
    """Map datatrove's (rank, index) outputs back to our doc_ids."""
    dt = work / "dt"
    id_maps = {int(p.stem): np.fromfile(p, dtype="<i8") for p in (dt / "ids").glob("*.ids")}

    clusters: dict[int, int] = {}
    for path in sorted((dt / "remove_ids").glob("*.clusters")):
        ids = id_maps[int(path.stem)]
        # Pairs of uint32: (index in that rank's stream, cluster id).
        pairs = _read_u32(path).reshape(-1, 2)
        for idx, cluster in pairs.tolist():
            clusters[int(ids[idx])] = cluster

    removed: set[int] = set()
    for path in sorted((dt / "remove_ids").glob("*.remove")):
        ids = id_maps[int(path.stem)]
        removed.update(int(ids[idx]) for idx in _read_u32(path).tolist())

    # Second route: what the filter stage actually excluded, carried by the documents' metadata.
    excluded: set[int] = set()
    for path in (dt / "removed").glob("*.jsonl"):
        with path.open(encoding="utf-8") as f:
            excluded.update(json.loads(line)["doc_id"] for line in f)
    if excluded != removed or not removed <= clusters.keys():
        raise RuntimeError(
            "datatrove id mapping disagrees: "
            f"{len(removed)} in .remove, {len(excluded)} excluded by the filter, "
            f"{len(removed - clusters.keys())} removed without a cluster"
        )
    return clusters, removed


def run_datatrove_minhash(
    docs: list[BenchDoc],
    workdir: Path,
    n_grams: int = 5,
    buckets: int = 14,
    hashes_per_bucket: int = 8,
    workers: int = 1,
) -> BaselineResult:
    """Run datatrove's four MinHash stages on ``docs`` under ``workdir``.

    The corpus is written as ``workers`` contiguous JSONL shards (datatrove shards by file, so
    one file would leave every other task idle). Previous outputs under ``workdir/dt`` are
    deleted first: datatrove's executor would otherwise skip "completed" tasks.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    work = Path(workdir).resolve()
    for sub in ("input", "dt"):
        shutil.rmtree(work / sub, ignore_errors=True)
    (work / "result.json").unlink(missing_ok=True)

    shard = -(-len(docs) // workers)  # ceil, so there are at most `workers` shards
    for i in range(workers):
        if chunk := docs[i * shard : (i + 1) * shard]:
            write_jsonl(chunk, work / "input" / f"{i:05d}.jsonl")

    config_path = work / "config.json"
    config_path.write_text(
        json.dumps(
            {
                "workdir": str(work),
                "n_grams": n_grams,
                "buckets": buckets,
                "hashes_per_bucket": hashes_per_bucket,
                "workers": workers,
            }
        )
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log_path = work / "datatrove.log"
    code = "import sys; from bench.datatrove_minhash import _child_main; _child_main(sys.argv[1])"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
        )
        with TreeMemorySampler(proc.pid) as sampler:
            rc = proc.wait()
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"datatrove subprocess failed ({rc}); log {log_path}:\n{tail}")

    result = json.loads((work / "result.json").read_text())
    clusters, removed = _collect(work)
    # The sampler can miss a spike shorter than its interval; a process's own maxrss cannot.
    peak_mb = max(
        sampler.peak_rss_bytes / 2**20, result["maxrss_self_mb"], result["maxrss_children_mb"]
    )
    return BaselineResult(
        seconds=result["seconds"],
        clusters=clusters,
        removed=removed,
        peak_rss_mb=peak_mb,
        stage_seconds=result["stage_seconds"],
        params=result["params"]
        | {
            "maxrss_self_mb": result["maxrss_self_mb"],
            "maxrss_children_mb": result["maxrss_children_mb"],
            "tree_peak_rss_mb": sampler.peak_rss_bytes / 2**20,
            "tree_peak_pss_mb": sampler.peak_pss_bytes / 2**20,
        },
    )
