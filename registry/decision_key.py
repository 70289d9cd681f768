"""The decision key: the secret with which the HTTP API vouches for a decision on a model, and
with which the control worker checks it before the run counts it.

A decision reaches a run as a Temporal update, and anyone who can reach Temporal can send one
naming any approver. So the API, which knows the person by their token, signs each decision
(workflows/contracts/decision_signature.py) and the run hands it to the control worker's
`verify_decision` activity before it counts; the workflow cannot hold the key itself, since its
history is readable by whoever reads Temporal.

The key lives in the object store (`settings/decision-key`, a `StoredDecisionKey`), the one
place both the API and the control worker reach: made once, create-if-absent, by the first of
them that needs it, and kept in memory for the process's life. Boxed ranks cannot read it (their
store door serves their own run's keys only), nor can people (they hold no store credential).
Deleting it rotates it: restart the API and the control workers after.
"""

from __future__ import annotations

import secrets
import threading
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import Field

from infra.errors import ObjectNotFound
from infra.store.protocol import ObjectStore
from infra.stored_format import StoredFormatError, StoredRecord

DECISION_KEY = "settings/decision-key"
DECISION_KEY_FORMAT = "forgeline.decision-key/1"
_KEY_BYTES = 32  # HMAC-SHA256's block is 64 bytes; 32 random bytes are past any guessing


class DecisionKeyInvalid(StoredFormatError):
    """The stored key cannot be read: nothing is signed or counted until it is replaced."""


class StoredDecisionKey(StoredRecord):
    """The key as stored, with who made it and when."""

    VERSIONS: ClassVar[tuple[Any, ...]] = (DECISION_KEY_FORMAT,)
    WHAT: ClassVar[str] = "decision key record"

    format: str = DECISION_KEY_FORMAT
    key: str = Field(pattern=r"^[0-9a-f]{64}$")  # hex
    created_by: str = ""
    created_at: str = ""  # ISO time


class DecisionKey:
    """The store's decision key, read (or made) at the first use and kept: one per process."""

    def __init__(self, store: ObjectStore, holder: str) -> None:
        self._store = store
        self._holder = holder  # who makes it, if it is made here ("forgeline api")
        self._lock = threading.Lock()
        self._key: bytes | None = None

    def get(self) -> bytes:
        with self._lock:
            if self._key is None:
                self._key = _read_or_make(self._store, self._holder)
            return self._key


def _read_or_make(store: ObjectStore, holder: str) -> bytes:
    try:
        raw = store.get_bytes(DECISION_KEY)
    except ObjectNotFound:
        made = StoredDecisionKey(
            key=secrets.token_hex(_KEY_BYTES),
            created_by=holder,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        # Whoever starts second keeps the first one's key: the API and the workers must agree.
        store.put_if_absent(DECISION_KEY, made.dump_bytes())
        raw = store.get_bytes(DECISION_KEY)
    try:
        return bytes.fromhex(StoredDecisionKey.parse(raw, f"{store.url}/{DECISION_KEY}").key)
    except StoredFormatError as err:
        raise DecisionKeyInvalid(
            f"{err}: delete it to make a new one, then restart the API and the control workers"
        ) from None
