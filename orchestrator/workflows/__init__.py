"""The use cases: one module per thing a front end (the CLI, serve, the playbooks, `orchestrator.Llama`)
asks of the fleet, each walking the stages below in flow order once.

* `options`: the typed options of a planning request (probe settings, the one builder of `PlanOptions`);
* `serve_options`: serve's own options, declared once (`rpcfleet serve`'s flags are made from them), and
  the one builder of its limits (`ServeConfig`);
* `fit`: the one fit policy (does the plan fit; the error, or the warning under `--force`);
* `plan`: `plan_for_fleet` -> `PlanRound` (probe, devices, local GPUs through the worker, plan, fit), and
  `plan_model` (read the model, then the hosts, then `plan_for_fleet`: `rpcfleet plan`, `cache warm`);
* `load`: `fleet_targets` and `load_on_fleet` (cache check, warm, dial, load);
* `run`: `run_on_fleet`, `rpcfleet run` whole (read the model, spawn the worker, plan, fit, load, generate);
* `change`: `deploy_fleet`, `service_fleet`, `rollback_fleet`, `status_fleet`, `logs_fleet`: a step of
  `operations/` on the selected hosts through the executor (`change_fleet`);
* `cache`: `cache_fleet` (status, verify, prune, clear) and `warm_fleet` (plan, then warm each node's share);
* `dropin`: `orchestrator.Llama`, the drop-in for `llama_cpp.Llama` (imports llama_cpp: never imported
  by the others, nor by this package).

The front ends hold no orchestration of their own: they parse their input into these options once, call
a workflow, and print what it returns.
"""
