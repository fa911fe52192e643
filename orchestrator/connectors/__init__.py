"""Connectors: a `Connection` to a host, over SSH (asyncssh, its only importer) or local, node-side
scripts, and the SSH forwards of `rpc_transport: ssh`. Imports inventory and core (the forwards use
engine's loop and threads).
"""
