"""The live page (orchestrator/observe/page.html) in headless Chromium, fed a `Snapshot` made of the
exporter's own records (no fleet, no server): the node table fits a 1400 px window with many nodes and
long names, and the request and token sparklines carry axes with units (the rates' min and max, the time
span) computed from the history given.

The page's own script is unchanged: a first script answers its `fetch("fleet.json")` with the snapshot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.observe.snapshot import DeviceView, Event, NodeView, Point, Snapshot
from orchestrator.observe.web import page_html
from tests.plugins.browser import CHROMIUM, chromium

GiB = 1024**3
WIDTH = 1400

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="needs chromium")


def many_nodes(count: int = 24) -> Snapshot:
    nodes = []
    for i in range(count):
        host = f"gpu-worker-{i:03d}.rack-{i % 4}.inference-cluster.datacenter-west.example.com"
        endpoint = f"{host}:50052"
        devices = tuple(
            DeviceView(
                j,
                f"{endpoint}#{j}",
                "NVIDIA GeForce RTX 4090 with a long description",
                "gpu",
                24 * GiB,
                (20 - j) * GiB,
                (19 - j) * GiB,
                held=(j + 1) * GiB,
            )
            for j in range(2)
        )
        nodes.append(
            NodeView(
                host,
                endpoint,
                ssh=True,
                state="running",
                probe="ok",
                version="b6123-0123456789abcdef0123456789abcdef01234567",
                protocol="7.0.0",
                restarts=i % 3,
                devices=devices,
                probed_at=1000.0,
            )
        )
    # running totals, one point a round (10 s): rates 0.5/s, 2/s, 1/s requests; 10/s, 40/s, 25/s tokens
    history = (
        Point(1000.0, 0, 0),
        Point(1010.0, 5, 100),
        Point(1020.0, 25, 500),
        Point(1030.0, 35, 750),
    )
    event = Event(1020.0, "restart", nodes[0].host, "the server was restarted by its supervisor " * 3)
    return Snapshot(1030.0, 5.0, tuple(nodes), (), (event,), history, 0.2, 4)


def page_with(snapshot: Snapshot, folder: Path) -> Path:
    """page.html with a first script that answers its fetch with `snapshot`'s JSON."""
    stub = (
        "<script>window.fetch = async () => ({status: 200, json: async () => ("
        + json.dumps(snapshot.to_json())
        + ")});</script>"
    )
    html = page_html()
    head_end = html.index("</head>")
    path = folder / "page.html"
    path.write_text(html[:head_end] + stub + html[head_end:])
    return path


def test_the_node_table_fits_a_1400_px_window(tmp_path: Path) -> None:
    page = page_with(many_nodes(), tmp_path)
    with chromium(tmp_path / "profile", width=WIDTH, height=900) as browser:
        browser.open(page.as_uri())
        browser.wait_for("document.querySelectorAll('tr.device').length === 48", 30)
        inner = browser.evaluate("window.innerWidth")
        scroll = browser.evaluate("document.documentElement.scrollWidth")
        table = browser.evaluate("document.getElementById('nodes').getBoundingClientRect().right")
        browser.screenshot(tmp_path / "page.png")
    assert inner == WIDTH
    assert scroll <= WIDTH, f"the page is {scroll} px wide in a {WIDTH} px window ({tmp_path / 'page.png'})"
    assert table <= WIDTH


def test_sparklines_have_axes_with_units(tmp_path: Path) -> None:
    page = page_with(many_nodes(2), tmp_path)
    with chromium(tmp_path / "profile", width=WIDTH, height=900) as browser:
        browser.open(page.as_uri())
        browser.wait_for("document.querySelectorAll('#rates svg').length === 2", 30)
        labels = browser.evaluate(
            "[...document.querySelectorAll('#rates svg')].map(svg => Object.fromEntries("
            "[...svg.querySelectorAll('text[data-axis]')].map(t => [t.dataset.axis, t.textContent])))"
        )
        axes = browser.evaluate(
            "[...document.querySelectorAll('#rates svg')].map(s => s.querySelectorAll('line.axis').length)"
        )
    requests, tokens = labels
    assert requests["y-max"] == "2.00 requests/s" and requests["y-min"] == "0.50 requests/s"
    assert tokens["y-max"] == "40.00 tokens/s" and tokens["y-min"] == "10.00 tokens/s"
    for axis in (requests, tokens):
        assert axis["x-start"] == "−20 s" and axis["x-end"] == "now"  # the rates span 1010 to 1030
    assert axes == [2, 2]  # an x and a y axis each
