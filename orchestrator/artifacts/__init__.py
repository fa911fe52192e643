"""Artifacts: pinned rpc-server builds (CPU, Vulkan, CUDA) from the binding's own source: the manifest,
the store, source patches, builds on this machine or on a node, imports of foreign binaries, and the
pinned build backend. Imports rpc and the stages below it.
"""
