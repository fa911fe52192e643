"""Caches: the servers' tensor caches seen from a load: which tensors a plan sends through them (their
hashes, `plan`), and checking and warming them before the load (`prep`, through operations' cache
steps). Touches no llama.cpp. Imports planning and the stages below it.
"""
