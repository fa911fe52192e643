"""The report screenshot of docs/planning.md (docs/report.png), made with no network: a synthetic 70B-class
model (its data a hole in the file) and a tiny one, planned on the fleet of scripts/report_fleet.yml with a
what-if node added (`--add gpu-a=2x24GiB:cuda`), rendered as HTML and shot by headless Chromium.

    python scripts/report_screenshot.py [-o docs/report.png]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.core.units import parse_size  # noqa: E402
from orchestrator.models.synth import write_sparse_70b_header, write_tiny_llama  # noqa: E402
from orchestrator.planning.profile import profile_model  # noqa: E402
from orchestrator.probe.capacity import DeviceCapacity  # noqa: E402
from orchestrator.probe.fleet import FleetProbe, NodeProbe  # noqa: E402
from orchestrator.report.build import ReportOptions, build_report  # noqa: E402
from orchestrator.report.html import render_html  # noqa: E402
from orchestrator.report.what_if import parse_what_if  # noqa: E402
from orchestrator.rpc.records import DeviceMemory, Outcome, ProbeResult, ProtocolVersion  # noqa: E402

FLEET = ROOT / "scripts" / "report_fleet.yml"
WIDTH, HEIGHT = 1400, 1500  # the summary, the curves and the fleet: the report's first screen


def node(entry: dict[str, object]) -> NodeProbe:
    """One fleet-file entry as the probe records an ok server of those devices."""
    host, endpoint, backend = str(entry["host"]), str(entry["endpoint"]), str(entry["backend"])
    sizes = [parse_size(str(s)) for s in entry["devices"]]  # type: ignore[attr-defined]
    devices = tuple(
        DeviceCapacity(
            host=host,
            endpoint=endpoint,
            index=i,
            name=f"{endpoint}#{i}",
            description=str(entry.get("description", "")),
            backend=backend,
            kind="cpu" if backend == "cpu" else "gpu",
            total=size,
            free=size,
            reserve=0,
            limit=None,
            usable=size,
            source_of_free="meminfo" if backend == "cpu" else "rpc",
        )
        for i, size in enumerate(sizes)
    )
    memory = tuple(DeviceMemory(d.index, d.free, d.total) for d in devices)
    rpc = ProbeResult(endpoint, Outcome.OK, ProtocolVersion(7, 0, 0), memory, "ok", 0.004)
    return NodeProbe(host, endpoint, rpc, None, devices, "ok")


def report_html(folder: Path) -> str:
    fleet = FleetProbe.of(
        [node(e) for e in yaml.safe_load(FLEET.read_text())["nodes"]], protocol="7.0.0", timeout=3.0
    )
    big = write_sparse_70b_header(folder / "llama-70b-q4_K.gguf")
    small = write_tiny_llama(folder / "tiny.gguf", n_layer=8, n_ctx_train=32768)
    models = [("llama-70b-q4_K.gguf", profile_model(big)), ("tiny.gguf", profile_model(small))]
    options = ReportOptions(generated_at="2026-01-01T00:00:00+00:00", inventory="inventory.yml")
    what_if = parse_what_if(["gpu-a=2x24GiB:cuda"], [])
    report = build_report(fleet, models, [4096, 32768, 131072], options, what_if=what_if)
    return render_html(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=ROOT / "docs" / "report.png")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("report_screenshot: chromium is not installed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "report.html"
        page.write_text(report_html(Path(tmp)))
        shot = Path(tmp) / "report.png"
        subprocess.run(
            [
                chromium,
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={tmp}/profile",
                f"--window-size={WIDTH},{HEIGHT}",
                f"--screenshot={shot}",
                page.as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        args.output.write_bytes(shot.read_bytes())
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
