"""`python -m orchestrator`: the `rpcfleet` program (`orchestrator.cli.run`)."""

import signal
import sys

from orchestrator.core import signals

# Set before anything else is imported: a signal during the imports below ends the run cleanly too.
signals.install()
try:
    from orchestrator.cli import run
except (KeyboardInterrupt, RuntimeError) as exc:
    if not signals.interrupted_by(exc):
        raise
    sys.stderr.write("interrupted\n")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exec("None")  # see orchestrator.cli.run: otherwise `python -m` may end by SIGINT, not 130
    sys.exit(130)
run()
