"""A model loaded in a worker process (the parent side, the child and the pipe between them), so that
losing a node never kills the caller; the parent never imports llama_cpp."""
