"""`rpcfleet serve`: the OpenAI API on a fleet, through a worker process (stage after playbooks).

`fleet` (hosts → endpoints, probe and plan, rolling restart), `backend` (worker, queue, recovery,
reload), `metrics` (counters, Prometheus text), `app` (FastAPI routes; imports fastapi and llama_cpp's
server models, so only `serve` loads it).
"""
