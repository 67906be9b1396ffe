"""``topomesh launch``: torchrun, plus a topology file for every worker.

The parser is torchrun's own (``torch.distributed.run.get_args_parser``) with a
``topomesh`` group added, and the launch is torchrun's own ``run(args)`` with the agent
class swapped for :class:`~topomesh.launch.agent.TopologyAgent`, so every torchrun flag,
environment variable (``PET_*``), ``@record`` error summary and exit code behaves as
with torchrun. Usage::

    topomesh launch --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=head:29400 --rdzv-id=job42 train.py --lr 3e-4

Topology options (before the script name): ``--topology {auto,off,PATH}``,
``--topology-probe``, ``--topology-dir DIR``, ``--topology-form {auto,dense,compact}``,
``--topology-timeout SECONDS``, ``--topology-probe-budget SECONDS``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from topomesh.errors import LaunchError
from topomesh.topology import api

_MODES = ("auto", "off")


HELP = "torchrun with a topology: every worker gets WORLD_TOPOLOGY_FILE, built during the rendezvous (takes all torchrun flags)."

def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with the topology options added (its flags are not re-declared)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "topomesh launch"
    parser.description = (
        "torchrun that builds the world topology during rendezvous and points every worker "
        f"at it with {api.ENV_VAR}. All torchrun options work unchanged."
    )
    group = parser.add_argument_group("topomesh", "topology options (put them before the training script)")
    group.add_argument(
        "--topology",
        default=os.environ.get("TOPOMESH_TOPOLOGY", "auto"),
        metavar="{auto,off,PATH}",
        help="auto: discover every node and exchange during rendezvous (default); off: plain "
        "torchrun; PATH: give every worker this file (its world size must match). "
        "Env: TOPOMESH_TOPOLOGY.",
    )
    group.add_argument(
        "--topology-probe",
        action="store_true",
        help="measure latency and bandwidth between nodes (TCP, time-boxed) and record them as measured",
    )
    group.add_argument(
        "--topology-dir",
        default=os.environ.get("TOPOMESH_TOPOLOGY_DIR"),
        help="base directory for topology files (default $TMPDIR/topomesh-<uid>); "
        "files go to <dir>/<run_id>/, mode 0700. Env: TOPOMESH_TOPOLOGY_DIR.",
    )
    group.add_argument(
        "--topology-form",
        choices=[f.value for f in api.FileForm],
        default=api.FileForm.AUTO.value,
        help=f"dense = RFC v0.1 (every pair); compact = for large worlds; auto = dense up to "
        f"{api.DENSE_MAX_RANKS} ranks",
    )
    group.add_argument(
        "--topology-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for the other nodes' topology after each rendezvous (default 120)",
    )
    group.add_argument(
        "--topology-probe-budget",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="time box for probing one peer node (default 2)",
    )
    return parser


def options_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~topomesh.launch.agent.TopologyOptions` the parsed flags describe."""
    from topomesh.launch.agent import TopologyMode, TopologyOptions

    choice = args.topology
    if choice in _MODES:
        mode, path = TopologyMode(choice), None
    else:
        if not os.path.isfile(choice):
            raise LaunchError(f"--topology {choice!r} is neither 'auto', 'off' nor an existing file")
        api.read_source(choice)  # fail before any process starts
        mode, path = TopologyMode.FILE, os.path.abspath(choice)
    return TopologyOptions(
        mode=mode,
        path=path,
        directory=args.topology_dir,
        form=api.FileForm(args.topology_form),
        probe=args.topology_probe,
        probe_budget_s=args.topology_probe_budget,
        timeout_s=args.topology_timeout,
    )


@contextlib.contextmanager
def _agent_class(factory: Any) -> Iterator[None]:
    """Make ``launch_agent`` build our agent (it instantiates this module-level name)."""
    import torch.distributed.launcher.api as launcher_api

    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``topomesh launch ARGS``; returns the exit code torchrun would give."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.run import run

    from topomesh.launch.agent import TopologyMode, agent_factory

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    options = options_from_args(args)

    @record
    def launch() -> None:
        if options.mode is TopologyMode.OFF:
            run(args)
            return
        with _agent_class(agent_factory(options)):
            run(args)

    try:
        launch()
    except ChildFailedError as exc:
        # torchrun lets this escape (traceback, exit 1) after @record wrote the error
        # file; print the same failure summary without the traceback.
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0
