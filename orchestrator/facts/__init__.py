"""Facts: each one a shell command and a pure parser of its output, gathered in one round trip per
host (`FACT_TYPES` is derived from the classes). Imports engine and the stages below it.
"""
