"""Planning: from a model's profile and the probed devices to a plan (layers, tensor_split, each
device's weights, KV and compute bytes) and to formations (which servers hold which copy of a model).
Pure: no I/O. Imports only the stages below it (pyproject.toml's import contract: probe and what is
under it)."""
