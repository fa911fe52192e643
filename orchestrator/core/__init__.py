"""Core: what every stage shares and that depends on nothing of rpcfleet: errors, logging, units,
paths, YAML with positions, durable files, signals, `Target`. Imports no other stage.
"""
