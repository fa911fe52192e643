"""`rpcfleet serve`: the OpenAI API on a fleet, through llama-server (stage after playbooks).

`fleet` (hosts → endpoints, probe and plan, rolling restart), `engine` (llama-server on a plan, behind the
`Engine` interface), `templates` (the chat template it uses), `backend` (slots, queue, recovery, rejoin,
reload), `metrics` (counters, Prometheus text), `upstream` (the HTTP client to the engine), `requests`
(the OpenAI request bodies), `app` (FastAPI routes; imports fastapi, so only `serve` loads it). No module
here imports llama_cpp.
"""
