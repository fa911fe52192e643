"""The serving machinery a formation is made of (stage below workflows: `workflows/serve.py` composes
it), all of it on the one loop that serves: no thread here.

`fleet` (what a formation needs of its fleet: `workflows.serving.ServeFleet` is the real one), `engine`
(llama-server on a plan, behind the `Engine` interface), `templates` (the chat template it uses),
`formation` (one formation, the one owner of its state: slots, queue, loads, reload; its `recovery` and
`rejoin` see it through a Protocol), `states` (its states and their allowed moves, its records), `pool`
and `spares` (the servers no formation holds, and their watch; which servers hold which copy of which
model is decided in planning.formations), `models_file` (serve's --models), `router` (the formations
behind the front: which one takes a request), `demand` (what the router asks of `on_demand`'s loads),
`metrics` (counters, Prometheus text), `upstream` (the one HTTP client to the engines), `requests` (the
OpenAI request bodies), `routes` (the OpenAI routes: Router → formation → engine), `app` (the front:
keys, health, metrics, admin; imports fastapi, so only `serve` loads it), `observed` (the formations as
the fleet exporter shows them). No module here imports llama_cpp.
"""
