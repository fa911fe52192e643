"""F15: secrets in rpc_env are masked wherever the inventory is shown, and key files that other users
may change draw a warning (serve's --keys file, the SSH key files an inventory names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.cli import _output, main
from orchestrator.serve.keys import exposed, hashed, parse_keys_file

SECRET = "hf_0123456789abcdef"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_output.console, "_width", 300)
    monkeypatch.setattr(_output.err_console, "_width", 400)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, " ".join(err.split())


def write_inventory(tmp_path: Path, key: Path, known_hosts: Path) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(
        "all:\n"
        "  hosts:\n"
        "    n1: {address: 192.0.2.1}\n"
        "    n2: {address: 192.0.2.2}\n"
        "  vars:\n"
        f"    ssh_key: {key}\n"
        f"    ssh_known_hosts: {known_hosts}\n"
        f"    rpc_env: {{HF_TOKEN: {SECRET}, GGML_VK_VISIBLE_DEVICES: '0'}}\n"
    )
    return path


def test_rpc_env_secrets_are_masked_in_list_and_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, known = tmp_path / "id_ed25519", tmp_path / "known_hosts"
    key.write_text("key\n")
    known.write_text("")
    key.chmod(0o600)
    known.chmod(0o644)
    inventory = str(write_inventory(tmp_path, key, known))
    status, out, err = run(capsys, "inventory", "list", "-i", inventory, "--json")
    assert (status, err) == (0, "")  # private files: no warning
    assert SECRET not in out
    assert [host["rpc_env"] for host in json.loads(out)] == [
        {"GGML_VK_VISIBLE_DEVICES": "0", "HF_TOKEN": "********"}
    ] * 2
    for argv in (["show", "n1"], ["show", "n1", "--json"]):
        status, out, _ = run(capsys, "inventory", *argv, "-i", inventory)
        assert status == 0 and SECRET not in out and "GGML_VK_VISIBLE_DEVICES" in out, out
    assert "HF_TOKEN=********" in run(capsys, "inventory", "show", "n1", "-i", inventory)[1]


@pytest.mark.parametrize("loose", ["key", "known_hosts"])
def test_an_ssh_key_file_others_may_change_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], loose: str
) -> None:
    key, known = tmp_path / "id_ed25519", tmp_path / "known_hosts"
    for path in (key, known):
        path.write_text("")
        path.chmod(0o600)
    (key if loose == "key" else known).chmod(0o664 if loose == "key" else 0o602)
    status, out, err = run(capsys, "inventory", "list", "-i", str(write_inventory(tmp_path, key, known)))
    assert status == 0 and "n1" in out
    if loose == "key":
        want = (
            f"warning: {key} (ssh_key of n1, n2) may be changed by other users (mode 664): chmod go-w {key}"
        )
    else:
        want = f"warning: {known} (ssh_known_hosts of n1, n2) may be changed by other users (mode 602)"
    assert want in err and err.count("warning:") == 1, err


def test_a_keys_file_others_may_change_is_exposed_even_with_hashed_keys(tmp_path: Path) -> None:
    path = tmp_path / "serve.keys"
    text = f"alice {hashed('sk-alice-0123456789abcdef')} inference\n"
    path.write_text(text)
    path.chmod(0o644)  # readable: the digests are no secret
    keys = parse_keys_file(path, text)
    assert exposed(keys) is None
    path.chmod(0o664)
    assert exposed(keys) == f"{path} may be changed by other users (mode 664): chmod go-w it"
    clear = "alice sk-alice-0123456789abcdef inference\n"
    path.write_text(clear)
    path.chmod(0o646)
    why = exposed(parse_keys_file(path, clear))
    assert why is not None and why.startswith(f"{path} may be changed by other users (mode 646)")
    assert "holds keys in clear and other users may read it (mode 646)" in why
