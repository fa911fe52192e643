"""serve's defaults that front ends show before anything is served: constants that import nothing (the
command line reads them at start-up, through `orchestrator.workflows.serve_options`; `backend` and `engine`
pull in the planner and the RPC client). `ServeConfig` and `engine` take their defaults from here."""

from __future__ import annotations

DEFAULT_PARALLEL = 4  # llama-server's own default for `--parallel` auto; see docs/serve.md
QUEUE_SIZE = 8  # requests waiting for a slot beyond those served
QUEUE_TIMEOUT = 120.0  # seconds a request may wait for a slot
RECOVER_TIMEOUT = 600.0  # seconds of recovery before giving up
LINK_TIMEOUT = 10.0  # seconds a cut link may stall the engine before it is declared lost
REJOIN_INTERVAL = 5.0  # seconds between two probes of the nodes left out (0: no watch)
SEED = 0  # the default sampling seed
ROUTING = "affine"  # prefix-affine routing between a model's formations (serve.affinity)
MIN_RESIDENT = 60.0  # seconds an on-demand model stays loaded at least (or twice its load, if longer)
SWAP_COOLDOWN = 30.0  # seconds after its last request before an on-demand model may be swapped out
