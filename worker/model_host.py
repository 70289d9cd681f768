"""The process a registered version's own code runs in: started by `forgeline generate` and
`forgeline serve` (worker.model_box), inside a box where it can, never in the caller's process.

    python -m worker.model_host generate FOLDER
        loads the model folder, then answers JSON lines on stdin, {"inputs": [prompts],
        "params": {...}}, with one JSON line each, {"predictions": [...]} or {"error": "..."}.
    python -m worker.model_host serve FOLDER --socket PATH [--workers N]
        MLflow's own scoring server (what `mlflow models serve` runs) on a unix socket: the box
        has no network, and the caller's relay (infra.socket_relay) carries HTTP to it.

Imports nothing of Forgeline's: everything here is MLflow's and the model's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.mode == "serve":
        serve(args.folder, args.socket, args.workers)
        return 0
    return generate(args.folder)


def generate(folder: str) -> int:
    # The answers travel on a stdout of their own: whatever the model's code prints (or a
    # library's warnings) goes to stderr, never into the caller's samples.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import mlflow.pyfunc

    model = mlflow.pyfunc.load_model(folder)
    for line in sys.stdin:
        if line.strip():
            _answer(model, line, answers)
    return 0


def _answer(model: Any, line: str, answers: IO[str]) -> None:
    try:
        request = json.loads(line)
        predictions = model.predict(request["inputs"], params=request.get("params") or {})
        answer: dict[str, Any] = {"predictions": [str(p) for p in predictions]}
    except Exception as err:  # one failed request is the caller's to report, not the end
        answer = {"error": f"{type(err).__name__}: {err}"}
    answers.write(json.dumps(answer) + "\n")
    answers.flush()


def serve(folder: str, socket: str, workers: int) -> None:
    import uvicorn
    from mlflow.pyfunc import scoring_server

    # How `mlflow models serve` hands its scoring app the model (scoring_server.get_cmd): the
    # app module loads the folder this variable names, in each worker.
    os.environ[scoring_server._SERVER_MODEL_PATH] = folder
    uvicorn.run("mlflow.pyfunc.scoring_server.app:app", uds=socket, workers=workers)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.model_host")
    parser.add_argument("mode", choices=("generate", "serve"))
    parser.add_argument("folder", help="the verified model folder")
    parser.add_argument("--socket", default="model.sock", help="serve: the unix socket")
    parser.add_argument("--workers", type=int, default=1, help="serve: each loads the model")
    return parser


if __name__ == "__main__":
    sys.exit(main())
