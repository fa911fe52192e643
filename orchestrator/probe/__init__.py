"""Probe: each device's capacity from the RPC answers and host facts (a node's free memory, GPU
VRAM), for the whole fleet at once. Imports operations and the stages below it.
"""
