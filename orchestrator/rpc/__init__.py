"""rpc: the ggml RPC wire format and the pure-Python client (HELLO, device count and memory).
Imports facts and the stages below it.
"""
