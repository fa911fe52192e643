"""requirements.lock matches pyproject.toml (scripts/lock.sh makes the one from the other).

scripts/setup.sh installs the shared venv from the lock alone (`--require-hashes --no-deps`), so a
dependency added to pyproject.toml and not locked would be missing there, a removed one would linger, and a
raised floor would go unnoticed. Checked offline, on the text of both files and uv's `# via` notes.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
# Set-up builds it from its pinned sdist (scripts/setup.sh step 2): its bytes vary by build.
OUTSIDE = "llama-cpp-python"
# uv's name for pyproject.toml in a `# via` note (the group `setup` as "rpcfleet (pyproject.toml:setup)")
PROJECT = re.compile(r"rpcfleet \(pyproject\.toml(?::[a-z-]+)?\)")
# The environment the lock is resolved for (scripts/lock.sh): a marker is judged in it.
TARGET = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}  # fmt: skip


@dataclass(frozen=True)
class Pin:
    name: str
    version: Version
    hashes: tuple[str, ...]
    via: tuple[str, ...]


def parse_lock(text: str) -> tuple[dict[str, Pin], set[str]]:
    """The pins of a uv `--generate-hashes` lock, and the packages it names as left out."""
    pins: dict[str, Pin] = {}
    excluded: set[str] = set()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("# The following packages were excluded"):
            excluded = {canonicalize_name(rest[2:]) for rest in lines[i + 1 :] if rest.startswith("# ")}
            break
        head = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+) \\", line)
        if head is None:
            assert not line.strip() or line.startswith("#"), f"requirements.lock:{i + 1}: {line!r}"
            i += 1
            continue
        hashes: list[str] = []
        via: list[str] = []
        i += 1
        while i < len(lines) and lines[i].startswith("    "):
            item = lines[i].strip()
            if found := re.fullmatch(r"--hash=sha256:([0-9a-f]{64})(?: \\)?", item):
                hashes.append(found.group(1))
            elif item.startswith("# via "):
                via.append(item.removeprefix("# via "))
            elif item.startswith("#   "):
                via.append(item.removeprefix("#   "))
            else:
                assert item == "# via", f"requirements.lock:{i + 1}: {item!r}"
            i += 1
        name = canonicalize_name(head.group(1))
        pins[name] = Pin(name, Version(head.group(2)), tuple(hashes), tuple(via))
    return pins, excluded


def declared() -> list[tuple[str, Requirement]]:
    """Every requirement of pyproject.toml that set-up installs, with where it is declared."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = [("dependencies", Requirement(r)) for r in meta["project"]["dependencies"]]
    for extra, reqs in meta["project"]["optional-dependencies"].items():
        found += [(f"extra {extra}", Requirement(r)) for r in reqs]
    for group, reqs in meta.get("dependency-groups", {}).items():
        found += [(f"group {group}", Requirement(r)) for r in reqs]
    return [(where, req) for where, req in found if req.marker is None or req.marker.evaluate(TARGET)]


def unlocked(
    pins: dict[str, Pin], excluded: set[str], requirements: list[tuple[str, Requirement]]
) -> list[str]:
    """The declared requirements that the lock does not satisfy."""
    wrong = []
    for where, req in requirements:
        name = canonicalize_name(req.name)
        if name == OUTSIDE:
            if name in pins or name not in excluded:
                wrong.append(f"{req} ({where}) is built by set-up: the lock must name it as left out")
        elif name not in pins:
            wrong.append(f"{req} ({where}) is not in the lock")
        elif not req.specifier.contains(pins[name].version, prereleases=True):
            wrong.append(f"{req} ({where}) is locked at {pins[name].version}")
    return wrong


def unexplained(
    pins: dict[str, Pin], excluded: set[str], requirements: list[tuple[str, Requirement]]
) -> list[str]:
    """The pins that no declared requirement needs, through uv's `# via` notes (who needs a pin), and the
    pins without a sha256 (pip's --require-hashes refuses the whole file then)."""
    direct = {canonicalize_name(req.name) for _, req in requirements}
    wrong = [] if excluded == {OUTSIDE} else [f"the lock leaves out {sorted(excluded)}, not [{OUTSIDE!r}]"]
    wrong += [f"{p.name}=={p.version} has no sha256" for p in pins.values() if not p.hashes]
    for pin in pins.values():
        if any(PROJECT.fullmatch(v) for v in pin.via) and pin.name not in direct:
            wrong.append(f"{pin.name}: the lock says pyproject.toml asks for it, pyproject.toml does not")
        strangers = [v for v in pin.via if not PROJECT.fullmatch(v) and canonicalize_name(v) not in pins]
        if strangers and strangers != [OUTSIDE]:
            wrong.append(f"{pin.name}: needed by {strangers}, which the lock does not hold")
    explained = {name for name in direct if name in pins or name == OUTSIDE}
    needs = {p.name: {canonicalize_name(v) for v in p.via} for p in pins.values()}
    while grown := {name for name, by in needs.items() if name not in explained and by & explained}:
        explained |= grown
    wrong += [f"{name}: nothing declared needs it" for name in sorted(set(pins) - explained)]
    return wrong


def test_the_lock_matches_pyproject() -> None:
    pins, excluded = parse_lock(LOCK.read_text())
    requirements = declared()
    wrong = unlocked(pins, excluded, requirements) + unexplained(pins, excluded, requirements)
    assert not wrong, "run scripts/lock.sh (docs/development.md):\n" + "\n".join(wrong)
    # llama-cpp-python stays out, its own dependencies are in (set-up installs its wheel with --no-deps)
    assert pins["diskcache"].via == (OUTSIDE,) and "jinja2" in pins
    assert {"pytest-xdist", "pip", "setuptools"} <= set(pins)


def test_a_lock_out_of_step_with_pyproject_is_named() -> None:
    """Each way a lock falls behind pyproject.toml shows: a new requirement, a raised floor, a dropped
    requirement (its pin and what only it needed linger), a lost hash."""
    text = LOCK.read_text()
    pins, excluded = parse_lock(text)
    requirements = declared()
    added = [*requirements, ("extra dev", Requirement("left-pad>=1"))]
    assert unlocked(pins, excluded, added) == ["left-pad>=1 (extra dev) is not in the lock"]
    raised = [(w, Requirement("asyncssh>=99") if r.name == "asyncssh" else r) for w, r in requirements]
    locked_at = pins["asyncssh"].version
    assert unlocked(pins, excluded, raised) == [f"asyncssh>=99 (dependencies) is locked at {locked_at}"]
    dropped = [(w, r) for w, r in requirements if r.name != "pytest-xdist"]
    assert unexplained(pins, excluded, dropped) == [
        "pytest-xdist: the lock says pyproject.toml asks for it, pyproject.toml does not",
        "execnet: nothing declared needs it",  # needed by pytest-xdist alone
        "pytest-xdist: nothing declared needs it",
    ]
    unhashed = re.sub(r"(?m)^(asyncssh==\S+) \\\n(?:    --hash.*\n)+", r"\1 \\\n", text)
    assert unexplained(*parse_lock(unhashed), requirements) == [
        f"asyncssh=={pins['asyncssh'].version} has no sha256"
    ]
