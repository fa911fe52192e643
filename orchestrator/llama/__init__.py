"""llama: everything that runs llama.cpp in a process: device registration, preflight, the loader,
the worker child, placements and the drop-in `Llama`'s plan. Imports planning and the stages below it.
"""
