"""Credentials found by their shape in text Forgeline did not write: what a rank prints is stored
as its run's logs and read by the run's team, and a key printed by mistake (`print(os.environ)`,
a dump of a request's headers, a key file read and echoed) must not be stored with it.

`infra.redact` masks the values Forgeline itself holds (its environment's secrets); this masks,
besides those, whatever looks like a credential, whoever's it is:

    AKIA/ASIA + 16           an AWS access key id                -> ***
    NAME=value               NAME with a part (between _ - .) ending in KEY, SECRET, TOKEN,
    'NAME': 'value'          PASSWORD, PASSWD, PASSPHRASE or CREDENTIAL(S): AWS_SECRET_ACCESS_KEY,
                             HF_TOKEN, db.password; not max_tokens or tokenizer; a number,
                             true/false or None is left (bos_token_id=50256)  -> NAME=***
    Authorization: Bearer x  any scheme, and `Bearer <16+ characters>` anywhere -> Bearer ***
    eyJ….eyJ….…              a JWT                               -> ***
    flt_<id>_<secret>        a Forgeline API token (infra.tokens) -> ***
    scheme://user:pw@host    a URL's password                    -> scheme://user:***@host
    -----BEGIN … PRIVATE KEY-----  the key's lines, up to its END line, are dropped
                             -> -----BEGIN RSA PRIVATE KEY-----*** and the END line

A log is redacted line by line as it is shipped (`trainer.rank_logs` ships complete lines only,
so a one-line credential is never split between two pieces). A private key spans lines: the
state `OpenKey` carries a key whose END has not come yet from one piece to the next.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from infra.redact import MASK, redact_text
from infra.tokens import TOKEN_SHAPE

# A key's body is a few dozen lines (a 16384-bit RSA key ~210); a first line whose end never
# comes (an error message quoting the header) must not swallow the rest of the log.
MAX_KEY_LINES = 256

_KEY_BLOCK = re.compile(
    r"(?P<begin>-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----)"
    r".*?(?:(?P<end>-----END [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----)|$)"
)
_KEY_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----")
_SECRET_PART = re.compile(r"(?:KEY|SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?)$", re.I)
# Values no credential is, printed under such names all the time by ML code.
_HARMLESS = re.compile(r"-?\d+(?:\.\d+)?|true|false|none|null|\*\*\*", re.I)
# A value: quoted (to its closing quote, or the line's end), or up to a space, quote or separator.
_VALUE = r"""(?P<value>"[^"]*"?|'[^']*'?|(?!=)[^\s'",;&)\]}]+)"""
_ASSIGNED = re.compile(rf"(?<![\w.-])(?P<name>[\w.-]+)\s*=\s*{_VALUE}")
_QUOTED_KEY = re.compile(rf"""(?P<q>['"])(?P<name>[\w.-]+)(?P=q)\s*[:=]\s*{_VALUE}""")
_SHAPES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"""(\bauthorization['"]?\s*[:=]\s*['"]?(?:(?:bearer|basic|token|digest)\s+)?)"""
            r"""[^\s"',]+""",
            re.I,
        ),
        rf"\1{MASK}",
    ),
    (re.compile(r"(\bbearer\s+)[A-Za-z0-9._~+/=-]{16,}", re.I), rf"\1{MASK}"),
    (re.compile(r"\beyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*"), MASK),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), MASK),
    (re.compile(TOKEN_SHAPE), MASK),
    (re.compile(r"(://[^/\s:@]+:)[^/\s@]+@"), rf"\1{MASK}@"),
)


@dataclass(frozen=True)
class OpenKey:
    """A private key's BEGIN line was shipped and its END line not yet: the lines between are
    dropped (`lines` so far, at most MAX_KEY_LINES)."""

    lines: int = 0


def names_a_secret(name: str) -> bool:
    """Whether a variable's or a field's name says it holds a credential."""
    return any(_SECRET_PART.search(part) for part in re.split(r"[_.-]", name))


def _mask_value(found: re.Match[str]) -> str:
    value = found["value"]
    bare = value.strip("'\"")
    if not bare or not names_a_secret(found["name"]) or _HARMLESS.fullmatch(bare):
        return found[0]
    quote = value[0] if value[0] in "'\"" else ""
    closing = quote if quote and len(value) > 1 and value.endswith(quote) else ""
    return found[0][: found.start("value") - found.start()] + quote + MASK + closing


def redact_shapes(text: str) -> str:
    """`text` (one line) with every one-line credential shape masked."""
    for pattern, replacement in _SHAPES:
        text = pattern.sub(replacement, text)
    return _QUOTED_KEY.sub(_mask_value, _ASSIGNED.sub(_mask_value, text))


def _mask_keys(body: str) -> tuple[str, bool]:
    """`body` with each private key on it masked; True when the last one's END is not on it."""
    left_open = False

    def mask(found: re.Match[str]) -> str:
        nonlocal left_open
        left_open = found["end"] is None
        return found["begin"] + MASK + (found["end"] or "")

    return _KEY_BLOCK.sub(mask, body), left_open


def _redact_line(line: str, secrets: list[str], key: OpenKey | None) -> tuple[str, OpenKey | None]:
    body, ending = (line[:-1], "\n") if line.endswith("\n") else (line, "")
    note = ""
    if key is not None:
        end = _KEY_END.search(body)
        if end is None and key.lines < MAX_KEY_LINES:
            return "", OpenKey(key.lines + 1)  # a line of the key's body
        if end is None:
            note = f"{MASK} ({MAX_KEY_LINES} lines after a private key's BEGIN, no END found)\n"
        body = body[end.start() :] if end is not None else body
    body, left_open = _mask_keys(redact_text(body, secrets))
    return note + redact_shapes(body) + ending, OpenKey() if left_open else None


def redact_log(
    text: str, secrets: Iterable[str], key: OpenKey | None = None
) -> tuple[str, OpenKey | None]:
    """`text`, lines of a log, with `secrets` (exact values, infra.redact.known_secrets) and
    every credential shape masked. `key` is what the piece before left open; the answer is the
    text and what this piece leaves open, for the next."""
    values = list(secrets)
    redacted = []
    for line in re.findall(r"[^\n]*\n|[^\n]+", text):
        masked, key = _redact_line(line, values, key)
        redacted.append(masked)
    return "".join(redacted), key
