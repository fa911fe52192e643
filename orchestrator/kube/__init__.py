"""Kubernetes: a formation as a LeaderWorkerSet (`rpcfleet export lws`) and the entry points its pods run
(`rpcfleet lws worker|plan|serve|hello|alive`).

- `group.py`: pure. The group's settings, the plan on the devices a group of pods is assumed to have,
  the devices its pods' servers report, and whether those differ enough to plan again.
- `lws_env.py`: pure. The variables LeaderWorkerSet gives each pod and the workers' addresses they imply.
- `manifests.py`: pure. The LeaderWorkerSet, Service and ConfigMap objects.
- `export.py`: the use case behind `rpcfleet export lws`: read the model, plan, write the manifests.
- `pods.py`: the pods' entry points: the rpc-server, the leader's init step (probe, re-plan, write
  llama-server's arguments), llama-server itself, the probes' checks (a HELLO to start, then the
  rpc-server's process).

docs/kubernetes.md says what was run here (a pseudo-LWS run in lab namespaces) and what was not (a cluster).
"""
