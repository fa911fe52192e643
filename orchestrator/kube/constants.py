"""The few names the pods' command line and the export share (pure, no imports: `cli/` reads them at
start-up, before any command has chosen what else to load)."""

from __future__ import annotations

BACKENDS = ("cpu", "cuda", "rocm", "vulkan")  # the rpc-server builds a pod may run
RPC_PORT = 50052  # every pod's rpc-server
HTTP_PORT = 8080  # the leader's llama-server
RUN_DIR = "/run/rpcfleet"  # each pod's emptyDir: llama-server's arguments, the rpc-server's pid file
PID_FILE = f"{RUN_DIR}/rpc-server.pid"  # `lws worker` writes it, `lws alive` (the probes) reads it
NODE_CPUS = 4  # each rpc-server's CPUs (request, limit and threads) unless the export says
CLIENT_LABEL = "rpcfleet/client"  # the pods that may call llama-server by default: rpcfleet/client=<name>
API_KEY_ITEM = "api-key"  # the Secret's key holding llama-server's keys, one a line (its --api-key-file)
