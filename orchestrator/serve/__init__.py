"""`rpcfleet serve`: the OpenAI API on a fleet, through llama-server (stage after playbooks).

`fleet` (hosts → endpoints, probe and plan, rolling restart), `engine` (llama-server on a plan, behind the
`Engine` interface), `templates` (the chat template it uses), `backend` (one formation: slots, queue,
recovery, rejoin, reload), `spares` (the servers no formation holds; which servers hold which copy of
which model is decided in planning.formations),
`models_file` (serve's --models), `router` (the formations behind the front: which one takes a request),
`metrics` (counters, Prometheus text), `upstream` (the HTTP client to the engine), `requests` (the OpenAI
request bodies), `app` (FastAPI routes; imports fastapi, so only `serve` loads it). No module here imports
llama_cpp.
"""
