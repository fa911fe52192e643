"""The README works as written: its Usage block runs line by line in a fresh shell that has only what
`make setup` leaves behind (the `rpcfleet` shim on PATH), and the shim runs the right checkout."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.core.paths import rpcfleet_home
from tests.plugins.lab import require_lab_privileges

ROOT = Path(__file__).resolve().parents[2]
SHIM_SCRIPT = ROOT / "scripts" / "install-shim.sh"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Lines that run until stopped: started, checked for their first output, then stopped with Ctrl-C,
# which ends following logs as journalctl -f does (status 0) and serving as any interrupt (130).
LONG_RUNNING = {"serve": ("ready on", 130), "--follow": ("labn1", 0)}


def usage_lines() -> list[str]:
    """The commands of the README's Usage block, comments dropped."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Usage\n") :]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, "README's Usage section has no ```sh block"
    lines = [line.split("  #", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def install_shim(bin_dir: Path, checkout: Path = ROOT) -> str:
    out = subprocess.run(
        ["bash", str(SHIM_SCRIPT), str(bin_dir), str(checkout)],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def fresh_env(home: Path, bin_dir: Path, rpcfleet_state: Path) -> dict[str, str]:
    """What a new login shell has: no venv, no PYTHONPATH, only the system PATH plus the shim's dir."""
    return {
        "HOME": str(home),
        "PATH": f"{bin_dir}:{SYSTEM_PATH}",
        "LANG": "C.UTF-8",
        "RPCFLEET_HOME": str(rpcfleet_state),
        **({"CI": os.environ["CI"]} if "CI" in os.environ else {}),
    }


def test_shim_runs_the_checkout_of_the_current_directory(tmp_path: Path) -> None:
    other = tmp_path / "other-clone"
    (other / ".venv" / "bin").mkdir(parents=True)
    (other / "scripts").mkdir()
    (other / "scripts" / "install-shim.sh").touch()
    fake = other / ".venv" / "bin" / "rpcfleet"
    fake.write_text('#!/bin/sh\necho other-clone "$@"\n')
    fake.chmod(0o755)
    bin_dir = tmp_path / "bin"
    assert "installed" in install_shim(bin_dir)
    env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}", "HOME": str(tmp_path)}
    inside = subprocess.run(
        ["rpcfleet", "x"], cwd=other / "scripts", env=env, capture_output=True, text=True, check=True
    )
    assert inside.stdout.strip() == "other-clone x"
    outside = subprocess.run(
        ["rpcfleet", "--version"], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    )
    assert outside.stdout.startswith("rpcfleet ")


def test_shim_leaves_a_foreign_rpcfleet_alone(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rpcfleet").write_text("#!/bin/sh\necho pip-installed\n")
    assert "left alone" in install_shim(bin_dir)
    assert (bin_dir / "rpcfleet").read_text() == "#!/bin/sh\necho pip-installed\n"


def test_setup_put_rpcfleet_on_the_path_of_a_new_login_shell() -> None:
    """`make setup` (which ran before the suite) installed the shim: a new login shell finds it."""
    if os.geteuid() != 0:
        pytest.skip("as another user the shim goes to ~/.local/bin, on PATH only once that exists at login")
    out = subprocess.run(
        ["env", "-i", f"HOME={Path.home()}", "bash", "-lc", "command -v rpcfleet && rpcfleet --version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    where, version = out.stdout.splitlines()
    assert where == "/usr/local/bin/rpcfleet"
    assert version.startswith("rpcfleet ")


@pytest.mark.lab
@pytest.mark.llama
def test_the_readme_usage_block_runs_as_written(tmp_path: Path) -> None:
    require_lab_privileges()
    lines = usage_lines()
    assert lines[0].startswith("rpcfleet model synth") and lines[-1] == "rpcfleet lab down"
    # Own state for the lab the block brings up (the default lab of another RPCFLEET_HOME), the builds
    # shared with the real cache.
    state = tmp_path / "rpcfleet-home"
    state.mkdir()
    for entry in rpcfleet_home().iterdir():
        if entry.name != "lab":
            (state / entry.name).symlink_to(entry)
    bin_dir = tmp_path / "bin"
    install_shim(bin_dir)
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "playbooks").symlink_to(ROOT / "playbooks")  # the block runs in a clone's directory
    env = fresh_env(tmp_path, bin_dir, state)
    try:
        for line in lines:
            long_running = next((how for key, how in LONG_RUNNING.items() if key in line), None)
            if long_running is None:
                out = subprocess.run(
                    ["bash", "-c", line], cwd=workdir, env=env, capture_output=True, text=True, timeout=240
                )
                assert out.returncode == 0, f"`{line}` exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
                assert "Traceback" not in out.stderr
                # the block's own contexts fit its model: no warning a new user would have to puzzle over
                assert "exceeds the model's training context" not in out.stdout + out.stderr, line
            else:
                run_until_ready(line, *long_running, workdir, env)
    finally:
        subprocess.run(["bash", "-c", "rpcfleet lab down"], cwd=workdir, env=env, capture_output=True)
    assert (workdir / "capacity.html").stat().st_size > 0


def run_until_ready(line: str, ready: str, status: int, cwd: Path, env: dict[str, str]) -> None:
    """Start a command that runs until stopped, wait for `ready` in its output, then press Ctrl-C: it
    ends with `status`, and without a traceback."""
    log = cwd / "long-running.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", f"exec {line}"], cwd=cwd, env=env, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 180
        while ready not in log.read_text():
            assert proc.poll() is None, f"`{line}` exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"`{line}` never printed {ready!r}:\n{log.read_text()}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == status, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()
    if status == 130:
        assert "interrupted" in log.read_text()
    shutil.move(log, cwd / f"{line.split()[1]}.log")


# A duration stated by hand (issue 21, item 11: "about 10 minutes" for a suite that took 12 min 53 s):
# the first-hour figures live in bench/firsthour.py's generated block, measured, with their machine.
GENERATED = re.compile(
    r"^<!-- (bench/[\w.]+\.py): generated, do not edit -->\n(.*?)^<!-- end \1 -->$", re.S | re.M
)
HAND_DURATION = re.compile(
    r"\b(?:takes?|took|runs? in)\s+(?:about\s+|around\s+)?\d+(?:\.\d+)?(?:\s+to\s+\d+)?\s?"
    r"(?:ms|s|min|minutes?|seconds?|hours?)\b"
    r"|\babout\s+\d+(?:\.\d+)?(?:\s+to\s+\d+)?\s+(?:minutes?|seconds?|hours?)\b"
    r"|\(\d+(?:\.\d+)?\s+to\s+\d+\s+(?:minutes|seconds)\)"
)


def hand_written_durations(text: str) -> list[str]:
    """Durations in `text` outside the blocks a bench script generated."""
    return [m.group(0) for m in HAND_DURATION.finditer(" ".join(GENERATED.sub("", text).split()))]


def test_the_readme_states_no_duration_by_hand() -> None:
    readme = (ROOT / "README.md").read_text()
    assert hand_written_durations(readme) == []
    block = GENERATED.search(readme)
    assert block is not None and block.group(1) == "bench/firsthour.py"
    assert (
        "`make test`" in block.group(2)
        and "`rpcfleet demo`" in block.group(2)
        and "fresh machine" in block.group(2)
    )
    # what the README said before (the figures) is caught
    old = "The first run takes about 15 minutes on 2 cores ... `make test` then runs in about 2 minutes."
    assert hand_written_durations(old) == ["takes about 15 minutes", "runs in about 2 minutes"]


@pytest.mark.parametrize(
    ("var", "message"),
    [
        ("rpc_cahce=true", "did you mean 'rpc_cache'"),
        ("rpc_cache", "expected KEY=VALUE"),
        ("rpc_port=[1", "not valid YAML"),
        ("rpc_port=hello", "--var"),
    ],
)
def test_lab_up_var_checks_the_variable_before_making_anything(
    var: str,
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from orchestrator.cli import main

    monkeypatch.setenv("RPCFLEET_HOME", str(tmp_path))
    assert main(["lab", "up", "--name", "varcheck", "--var", var]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "lab" / "varcheck").exists()
