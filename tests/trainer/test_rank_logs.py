"""Rank logs shipped as append-only pieces: complete lines while running, the rest at the end,
nothing twice; a store that is away costs a round, not the attempt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from infra.store.local import LocalStore
from trainer.rank_logs import MAX_SHIP_BYTES, LogShipper, pieces, shipped_while_running


def _text(store: LocalStore, run: str, name: str) -> str:
    return "".join(store.get_bytes(p.key).decode() for p in pieces(store, run) if p.name == name)


def test_complete_lines_ship_while_running_and_the_rest_at_the_end(tmp_path: Path) -> None:
    store, folder = LocalStore(tmp_path / "store"), tmp_path / "gen-3"
    folder.mkdir()
    (folder / "rank-1.log").write_text("step 5 loss 2.1\nstep 10 lo")
    (folder / "torchrun.log").write_text("started\n")
    (folder / "progress.jsonl").write_text("{}\n")  # not a log: never shipped
    shipper = LogShipper(store, "run", 3, "h2", folder)
    assert shipper.ship() == len("step 5 loss 2.1\n") + len("started\n")
    assert _text(store, "run", "rank-1") == "step 5 loss 2.1\n"
    assert shipper.ship() == 0  # nothing new: no empty pieces

    with open(folder / "rank-1.log", "a") as log:
        log.write("ss 2.0\nTraceback (most recent call last):")  # the rank died mid-line
    shipper.ship(final=True)
    assert _text(store, "run", "rank-1") == (folder / "rank-1.log").read_text()
    found = pieces(store, "run")
    assert {(p.generation, p.node_id, p.name) for p in found} == {
        (3, "h2", "rank-1"), (3, "h2", "torchrun")
    }  # fmt: skip
    assert [p.rank for p in found if p.name == "rank-1"] == [1, 1]  # two rounds, two pieces
    assert all(p.rank is None for p in found if p.name == "torchrun")


class _Away(LocalStore):
    """A store that fails its first puts, as one whose site is briefly unreachable."""

    failures = 2

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("store away")
        super().put_bytes(key, data)


def test_a_store_that_is_away_gets_the_lines_on_a_later_round(tmp_path: Path) -> None:
    store, folder = _Away(tmp_path / "store"), tmp_path / "gen-1"
    folder.mkdir()
    shipper = LogShipper(store, "run", 1, "h1", folder)

    async def attempt() -> None:
        async with shipped_while_running(shipper, every_s=0.05):
            for index in range(10):
                with open(folder / "rank-0.log", "a") as log:
                    log.write(f"line {index}\n")
                await asyncio.sleep(0.03)

    asyncio.run(attempt())
    assert _text(store, "run", "rank-0") == "".join(f"line {i}\n" for i in range(10))


TOKEN = "flt_0123456789ab_" + "Q" * 43
KEY_BODY = ["MIIEpAIBAAKCAQEA3Tz2mr7SZiAMfQyuvBjM2Uo", "b0yPwMnj6pBQhkXrUL3SWVLgSM0pZ3OhM2f=="]
# Each line a rank might print, and what the store must hold instead.
PRINTED = {
    "aws key id AKIAIOSFODNN7EXAMPLE, session ASIAY34FZKBOKMUTVV7A": "aws key id ***, session ***",
    "export AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY": (
        "export AWS_SECRET_ACCESS_KEY=***"
    ),
    "environ({'HOME': '/root', 'FORGELINE_TEMPORAL_API_KEY': 'tmprl.AbC-0123456789'})": (
        "environ({'HOME': '/root', 'FORGELINE_TEMPORAL_API_KEY': '***'})"
    ),
    "> Authorization: Bearer sk-live-0123456789abcdef": "> Authorization: Bearer ***",
    "{'authorization': 'Basic dXNlcjpwYXNzd29yZA=='}": "{'authorization': 'Basic ***'}",
    "id token eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJyaGVhIn0.c2lnbmF0dXJl-_x ok": "id token *** ok",
    f"FORGELINE_TOKEN={TOKEN}": "FORGELINE_TOKEN=***",
    f"my token is {TOKEN}.": "my token is ***.",
    'HF_TOKEN=hf_AbCdEf012345 db.password="hunter2" --api-key=k-9': (
        'HF_TOKEN=*** db.password="***" --api-key=***'
    ),
    '{"client_secret": "cs-42", "credentials": "c:d", "n_layer": 4}': (
        '{"client_secret": "***", "credentials": "***", "n_layer": 4}'
    ),
    "mlflow at https://writer:pw-0123@mlflow:5000": "mlflow at https://writer:***@mlflow:5000",
    # The agent's own secret, printed bare: found by its value.
    "connecting with agents-own-mlflow-password": "connecting with ***",
    # Not credentials, though their names say token or key: numbers, counts, a tokenizer.
    "step 10 max_tokens=512 tokens_per_s=1834.5 bos_token_id=50256 tokenizer=gpt2 key_dim=64": (
        "step 10 max_tokens=512 tokens_per_s=1834.5 bos_token_id=50256 tokenizer=gpt2 key_dim=64"
    ),
}


def test_every_credential_shape_is_stored_redacted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "agents-own-mlflow-password")
    store, folder = LocalStore(tmp_path / "store"), tmp_path / "gen-1"
    folder.mkdir()
    pem = ["-----BEGIN RSA PRIVATE KEY-----", *KEY_BODY, "-----END RSA PRIVATE KEY-----"]
    (folder / "rank-0.log").write_text("\n".join([*PRINTED, *pem, "after the key"]) + "\n")
    # A key printed as Python shows a string: on one line, its newlines as \n.
    one_line = f"-----BEGIN PRIVATE KEY-----\\n{KEY_BODY[0]}\\n-----END PRIVATE KEY-----"
    (folder / "torchrun.log").write_text(f"[rank0]: read '{one_line}'\n")
    LogShipper(store, "run", 1, "h1", folder).ship(final=True)

    stored = _text(store, "run", "rank-0").splitlines()
    assert stored[: len(PRINTED)] == list(PRINTED.values())
    assert stored[len(PRINTED) :] == [
        "-----BEGIN RSA PRIVATE KEY-----***", "-----END RSA PRIVATE KEY-----", "after the key"
    ]  # fmt: skip
    assert _text(store, "run", "torchrun") == (
        "[rank0]: read '-----BEGIN PRIVATE KEY-----***-----END PRIVATE KEY-----'\n"
    )


class _AwayOnce(LocalStore):
    """A store whose next put fails when told."""

    fail_next = False

    def put_bytes(self, key: str, data: bytes) -> None:
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("store away")
        super().put_bytes(key, data)


def test_a_credential_split_between_shipments_is_still_redacted(tmp_path: Path) -> None:
    """A line is held back until it is whole; a private key's body is dropped from the piece
    after its first line, even when the put of that piece failed once and was shipped again."""
    store, folder = _AwayOnce(tmp_path / "store"), tmp_path / "gen-1"
    folder.mkdir()
    log = folder / "rank-0.log"
    shipper = LogShipper(store, "run", 1, "h1", folder)

    def prints(text: str) -> None:
        with open(log, "a") as handle:
            handle.write(text)

    prints("step 1\nHF_TOKEN=hf_AbCdEf")
    shipper.ship()
    prints("012345\n-----BEGIN OPENSSH PRIVATE KEY-----\n" + KEY_BODY[0] + "\n")
    shipper.ship()
    prints(KEY_BODY[1] + "\n-----END OPENSSH PRIVATE KEY-----\nstep 2\n")
    store.fail_next = True
    with pytest.raises(ConnectionError):
        shipper.ship()
    shipper.ship()
    prints("last: SECRET=s3cr3t-tail")
    shipper.ship(final=True)

    assert _text(store, "run", "rank-0") == (
        "step 1\nHF_TOKEN=***\n-----BEGIN OPENSSH PRIVATE KEY-----***\n"
        "-----END OPENSSH PRIVATE KEY-----\nstep 2\nlast: SECRET=***"
    )


def test_a_line_that_never_ends_is_named_not_shipped_and_not_read_whole(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    folder = tmp_path / "gen-1"
    folder.mkdir()
    log = folder / "rank-0.log"
    log.write_bytes(b"before\n" + b"x" * (MAX_SHIP_BYTES + (1 << 20)))
    shipper = LogShipper(store, "run", 1, "h1", folder)
    assert shipper.ship() <= MAX_SHIP_BYTES  # one round reads at most that much
    assert shipper.ship() <= MAX_SHIP_BYTES
    with open(log, "ab") as handle:
        handle.write(b"\nafter\n")
    shipper.ship()
    assert _text(store, "run", "rank-0") == (
        f"before\n[a line of more than {MAX_SHIP_BYTES} bytes, not shipped]\nafter\n"
    )
