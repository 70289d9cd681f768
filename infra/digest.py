"""Content hashes used by every manifest (datasets and checkpoints)."""

import hashlib
import re
from pathlib import Path

_CHUNK = 1 << 20
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: object) -> bool:
    """A lowercase hex sha256: the only kind of name from a manifest that may become a path
    (never "../" or a name a crafted manifest chose)."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
