"""Engine: the runtime, the one home of event loops, threads, signals and child processes: one loop
and one `Session` per command, the executor (forks, batches, failures, interrupts), `Shared`,
`gather_bounded`, `children`. Imports connectors and the stages below it.
"""
