"""Packaging and set-up: the wheel installs a working `rpcfleet`, and every checkout runs its own code.

Both stay offline and take seconds: the wheel is built without build isolation (the setuptools of this
environment), installed with --no-deps into a fresh venv that sees this environment's packages through a
path entry, and run from a temporary folder without PYTHONPATH, so only the installed copy can answer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "tests" / "data" / "inventory" / "fleet_ansible.yml"
# The environment that holds the dependencies (the shared venv; this .venv only points at it).
DEPS_SITE = Path(yaml.__file__).resolve().parent.parent
SHARED_VENV = DEPS_SITE.parents[2]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(argv: list[str | Path], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def _copy_checkout(dest: Path, *parts: str) -> Path:
    dest.mkdir(parents=True)
    for part in parts:
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, dest / part)
    return dest


def _purelib(python: Path) -> Path:
    out = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], Path("/"))
    return Path(out.stdout.strip())


def test_the_wheel_installs_a_working_rpcfleet(tmp_path: Path) -> None:
    source = _copy_checkout(tmp_path / "src", "pyproject.toml", "README.md", "orchestrator")
    dist = tmp_path / "dist"
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, source],
        tmp_path,
    )
    (wheel,) = dist.glob("rpcfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in (
        "orchestrator/cli/__init__.py",
        "orchestrator/cli/model.py",
        "orchestrator/models/synth.py",
    ):
        assert module in names  # the subpackages are in the wheel (it once held orchestrator/ alone)
    assert "orchestrator/py.typed" in names and not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        tmp_path,
    )
    # The dependencies from this environment: a plain path entry, after the venv's own site-packages.
    (_purelib(python) / "deps.pth").write_text(f"{DEPS_SITE}\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([python, "-c", "import orchestrator; print(orchestrator.__file__)"], work).stdout.strip()
    assert where.startswith(str(venv)), where  # the installed copy, not a checkout
    rpcfleet = venv / "bin" / "rpcfleet"
    assert _run([rpcfleet, "--version"], work).stdout.strip() == "rpcfleet 0.1.0"
    assert "model" in _run([rpcfleet, "--help"], work).stdout
    listing = _run([rpcfleet, "inventory", "list", "-i", FLEET, "--json"], work)
    assert [h["name"] for h in yaml.safe_load(listing.stdout)][:2] == ["bastion", "a100-01"]


def test_each_checkout_gets_a_venv_that_runs_its_own_code(tmp_path: Path) -> None:
    checkouts = [_copy_checkout(tmp_path / name, "orchestrator", "scripts") for name in ("one", "two")]
    for checkout in checkouts:
        _run(["bash", checkout / "scripts" / "checkout-venv.sh", SHARED_VENV, checkout], tmp_path)
    # A change in one checkout shows in that checkout only.
    init = checkouts[1] / "orchestrator" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', '__version__ = "0.1.0+two"'))
    work = tmp_path / "elsewhere"
    work.mkdir()
    for checkout, version in zip(checkouts, ("0.1.0", "0.1.0+two"), strict=True):
        python = checkout / ".venv" / "bin" / "python"
        code = "import orchestrator, llama_cpp; print(orchestrator.__file__)"
        assert _run([python, "-c", code], work).stdout.strip() == str(
            checkout / "orchestrator" / "__init__.py"
        )
        assert (
            _run([checkout / ".venv" / "bin" / "rpcfleet", "--version"], work).stdout.strip()
            == f"rpcfleet {version}"
        )
        pytest_script = (checkout / ".venv" / "bin" / "pytest").read_text().splitlines()[0]
        assert pytest_script == f"#!{python}"  # the shared tools run on this checkout's python
    # Idempotent and quick when nothing changed; an old symlinked .venv is replaced by a real one.
    stamp = checkouts[0] / ".venv" / ".rpcfleet-checkout-venv"
    before = stamp.stat()
    _run(["bash", checkouts[0] / "scripts" / "checkout-venv.sh", SHARED_VENV, checkouts[0]], tmp_path)
    after = stamp.stat()  # the .venv was left as it was, not made again
    assert (after.st_ino, after.st_ctime_ns) == (before.st_ino, before.st_ctime_ns)
    link = _copy_checkout(tmp_path / "linked", "orchestrator", "scripts")
    (link / ".venv").symlink_to(SHARED_VENV)
    _run(["bash", link / "scripts" / "checkout-venv.sh", SHARED_VENV, link], tmp_path)
    assert not (link / ".venv").is_symlink() and (SHARED_VENV / "bin" / "python").exists()
