"""`python -m orchestrator`: the `rpcfleet` program (`orchestrator.cli.run`)."""

import signal
import sys


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


# Set before anything else is imported: a signal during the imports below ends the run cleanly too.
signal.signal(signal.SIGTERM, _terminate)
try:
    from orchestrator.cli import run
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exec("None")  # see orchestrator.cli.run: otherwise `python -m` may end by SIGINT, not 130
    sys.exit(130)
run()
