"""Playbooks: YAML playbooks (a reader with positions, a runner over the executor, a registry of
steps). Imports workflows and the stages below it.
"""
