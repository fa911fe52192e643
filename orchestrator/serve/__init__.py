"""`rpcfleet serve`: the OpenAI API on a fleet, through a worker process (stage after playbooks).

`fleet` (hosts → endpoints, probe and plan, rolling restart), `backend` (worker, queue, recovery,
reload), `metrics` (counters, Prometheus text), `requests` (the OpenAI request bodies), `app` (FastAPI
routes; imports fastapi, so only `serve` loads it). No module here imports llama_cpp: it runs in the worker.
"""
