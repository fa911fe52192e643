"""serve's per-user keys (`--keys FILE`): who may call which routes, for which models (pure: text in, keys
out; errors name the file and line, never quote it: a line holds a secret).

    # NAME   KEY                    SCOPES            [MODELS]
    alice    sk-alice-0123456789ab  inference         gemma,tiny
    ops      sha256:5e884898da28... admin,metrics
    grafana  sk-grafana-0123456789  metrics

One key a line, whitespace between the fields; `#` starts a comment. NAME is what logs and metrics show
(letters, digits, `_.-`); KEY is the bearer token itself (16 characters at least) or `sha256:` and its
hex digest, so the file need not hold it in clear. SCOPES, comma-separated: `inference` (the `/v1/*`
routes), `metrics` (`/metrics`, the live page, `/health`'s details), `admin` (`/admin/*`, `/slots`).
MODELS, comma-separated, limits `inference` to those models (default: every model served).

A presented key is hashed and compared with every entry's digest (`hmac.compare_digest`), so a clear key
and a hashed one are checked alike, in a time that does not depend on where the keys differ.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.errors import SourceLocation, UsageError
from orchestrator.core.files import loose_write_mode
from orchestrator.core.yamlsource import did_you_mean

SCOPES = ("inference", "metrics", "admin")
MIN_KEY_LENGTH = 16  # characters of a clear key: shorter ones are guessable
HASHED = "sha256:"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # safe in a Prometheus label and a log line as it is
_WORD = re.compile(r"[a-z_]{1,16}")
_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class UserKey:
    """One line of a keys file: its name, the sha256 of its key, its scopes, and the models it may use
    (None: every model)."""

    name: str
    digest: bytes
    scopes: frozenset[str]
    models: frozenset[str] | None
    line: int

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class Keys:
    """A keys file as read: its entries (`find` the one a request presents). `clear`: whether a key is
    in clear (the file is then a secret: see `exposed`)."""

    path: Path
    entries: tuple[UserKey, ...]
    clear: bool

    def find(self, presented: str) -> UserKey | None:
        """The entry whose key is `presented` (None: none). Every entry is compared, found or not."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for entry in self.entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found

    def named(self, name: str) -> UserKey | None:
        return next((e for e in self.entries if e.name == name), None)


class KeyRing:
    """The keys in force, for the routes to read: a reload replaces `keys` whole (one assignment on
    serve's loop), so a request sees the old keys or the new ones, never a mix."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys


def parse_keys_file(path: Path, text: str, models: Sequence[str] | None = None) -> Keys:
    """The keys of `text` (the file `path`); `models`: the models served, which a key's list must name.
    UsageError `FILE:LINE: ...` (exit 2) for a bad line; the line itself is never quoted."""
    entries: list[UserKey] = []
    names: dict[str, int] = {}
    digests: dict[bytes, int] = {}
    clear = False
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = SourceLocation(path, number)
        if len(fields) < 3:
            raise UsageError(
                f"expected NAME KEY SCOPES [MODELS], got {len(fields)} field{'s' if len(fields) > 1 else ''}",
                where,
            )
        if len(fields) > 4:
            raise UsageError(
                f"expected NAME KEY SCOPES [MODELS], got {len(fields)} fields (a list has no spaces: a,b)",
                where,
            )
        name, key, scopes_text = fields[:3]
        if not _NAME.fullmatch(name):
            raise UsageError(f"the name {name!r} may hold only letters, digits, '_', '.' and '-'", where)
        if name in names:
            raise UsageError(f"the name {name!r} is already the key's of line {names[name]}", where)
        digest = _digest(key, where)
        clear = clear or not key.startswith(HASHED)
        if digest in digests:  # the name of the other line only: never the key
            raise UsageError(f"{name}: the same key as line {digests[digest]}'s", where)
        scopes = _list(scopes_text, "scopes", where)
        for scope in scopes:
            if scope not in SCOPES:  # quoted when it is a word: a key that slid into its place is not
                said = f" {scope!r}{did_you_mean(scope, SCOPES)}" if _WORD.fullmatch(scope) else ""
                raise UsageError(f"{name}: unknown scope{said} (scopes: {', '.join(SCOPES)})", where)
        allowed = None
        if len(fields) == 4:
            allowed = frozenset(_list(fields[3], "models", where))
            unknown = sorted(allowed - set(models)) if models is not None else []
            if unknown and models is not None:
                raise UsageError(
                    f"{name}: the model {unknown[0]!r}{did_you_mean(unknown[0], models)} is not served "
                    f"(served: {', '.join(models)})",
                    where,
                )
            if "inference" not in scopes:
                raise UsageError(f"{name}: a model list limits the inference scope, which it lacks", where)
        names[name] = digests[digest] = number
        entries.append(UserKey(name, digest, frozenset(scopes), allowed, number))
    if not entries:
        raise UsageError("the keys file holds no key", SourceLocation(path, None))
    return Keys(path, tuple(entries), clear)


def read_keys_file(path: Path, models: Sequence[str] | None = None) -> Keys:
    """The keys file `path` read and parsed (UsageError naming it when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise UsageError(f"--keys {path}: {why}") from None
    return parse_keys_file(path, text, models)


def exposed(keys: Keys) -> str | None:
    """Why other users may read the file's clear keys, or change the file (and so add a key of their own,
    hashed or not); None when they may do neither."""
    reasons = []
    loose = loose_write_mode(keys.path)
    if loose is not None:
        reasons.append(f"{keys.path} may be changed by other users (mode {loose:o}): chmod go-w it")
    try:
        mode = keys.path.stat().st_mode
    except OSError:
        mode = 0
    if keys.clear and mode & (stat.S_IRGRP | stat.S_IROTH):
        reasons.append(
            f"{keys.path} holds keys in clear and other users may read it (mode {stat.S_IMODE(mode):o}): "
            f"chmod 600 it, or write each key as sha256:HEX"
        )
    return "; ".join(reasons) or None


def hashed(key: str) -> str:
    """`key` as a keys file may hold it without the secret: `sha256:HEX`."""
    return HASHED + hashlib.sha256(key.encode()).hexdigest()


def _digest(key: str, where: SourceLocation) -> bytes:
    if key.startswith(HASHED):
        hex_digest = key[len(HASHED) :].lower()
        if not _HEX.fullmatch(hex_digest):
            raise UsageError("a hashed key is sha256: and 64 hexadecimal digits", where)
        return bytes.fromhex(hex_digest)
    if len(key) < MIN_KEY_LENGTH:
        raise UsageError(f"the key is shorter than {MIN_KEY_LENGTH} characters: too easy to guess", where)
    return hashlib.sha256(key.encode()).digest()


def _list(text: str, what: str, where: SourceLocation) -> list[str]:
    items = text.split(",")
    if any(not item for item in items):
        raise UsageError(f"an empty item in the {what} list {text!r}", where)
    return list(dict.fromkeys(items))
