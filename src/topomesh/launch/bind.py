"""``python -m topomesh.launch.bind PROGRAM ARGS...``: bind to ``$TOPOMESH_WORKER_CPUS``, then exec.

The agent starts each worker through this wrapper when it binds workers itself
(:mod:`topomesh.launch.numa`): the affinity is set before the program runs, so every thread
it starts (OpenMP, gloo, data loaders) inherits it, and ``exec`` keeps it.
"""

from __future__ import annotations

import os
import sys

from topomesh.launch.numa import ENV_VAR
from topomesh.topology.discover import parse_cpulist


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m topomesh.launch.bind PROGRAM [ARGS...]")
    cpus = parse_cpulist(os.environ.get(ENV_VAR))
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
