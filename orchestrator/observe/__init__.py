"""Seeing the fleet: a probe loop that keeps a snapshot, its Prometheus text and a live page.

`collect.Collector` probes the fleet on a fixed interval (the probe's rules: a server holding a client is
never probed over RPC) and keeps the last `snapshot.Snapshot`; `prometheus.render` and the page's JSON
read that snapshot only, so a scrape never waits on the fleet. `web.mount` adds the page, its JSON and
its login to a FastAPI app: `rpcfleet exporter` makes one of its own, `serve` mounts them on its app.
"""
