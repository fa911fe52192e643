"""`rpcfleet serve`: the OpenAI API on a fleet, through llama-server (stage after playbooks).

`fleet` (hosts → endpoints, probe and plan, rolling restart), `engine` (llama-server on a plan, behind the
`Engine` interface), `templates` (the chat template it uses), `backend` (slots, queue, recovery, rejoin,
reload), `metrics` (counters, Prometheus text), `upstream` (the HTTP client to the engine), `app`
(FastAPI routes; imports fastapi and llama_cpp's server models, so only `serve` loads it).
"""
