"""llama.cpp in this process: libllama through ctypes, the load and the RPC registry (for the worker
child and the drop-in `Llama`)."""
