"""The pinned build backend: a virtual environment holding exactly the build dependencies of the
llama-cpp-python sdist (scikit-build-core and what it needs), each pinned by version and sha256 in
`build-requirements.txt` beside this file.

pip's default build isolation would install whatever version of them the registry offers at that moment,
for the metadata step of `pip download` as for the wheel build. rpcfleet runs both with
`--no-build-isolation` from this environment's Python instead, so no unpinned code takes part in making
the sdist a wheel (and pip checks the sdist's own sha256 before either step: a changed file runs nothing).

Standard library only, and runnable as a script: `scripts/setup.sh` makes the environment with this file
before any other dependency exists (`python3 buildenv.py HOME` prints the environment's Python).
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
import sys
from pathlib import Path

BUILD_REQUIREMENTS = Path(__file__).with_name("build-requirements.txt")

PIP_TIMEOUT_S = 600.0


def build_env_dir(home: Path) -> Path:
    """`HOME/build-env/<key>`: keyed by the pins and this Python's version, so a change of either makes
    a new environment and never changes one in use."""
    key = hashlib.sha256(BUILD_REQUIREMENTS.read_bytes() + platform.python_version().encode()).hexdigest()
    return home / "build-env" / key[:12]


def ensure_build_env(home: Path) -> Path:
    """The Python of the pinned build environment under `home`, made when missing (wheels only, every
    file checked against its sha256). Raises RuntimeError with pip's output when that fails."""
    env = build_env_dir(home)
    python = env / "bin" / "python"
    if (env / ".ready").is_file():
        return python
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", str(env)],
        [
            str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--require-hashes",
            "--no-deps", "--only-binary", ":all:", "-r", str(BUILD_REQUIREMENTS),
        ],
    ]  # fmt: skip
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        if done.returncode != 0:
            shutil.rmtree(env, ignore_errors=True)
            raise RuntimeError(
                f"making the pinned build environment {env} failed: {' '.join(argv)} exited with "
                f"{done.returncode}\n{done.stderr.strip() or done.stdout.strip()}"
            )
    (env / ".ready").touch()
    return python


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} RPCFLEET_HOME")
    try:
        print(ensure_build_env(Path(sys.argv[1])))
    except RuntimeError as exc:
        sys.exit(str(exc))
