"""``topomesh launch``: torchrun, plus a topology file for every worker.

The parser is torchrun's own (``torch.distributed.run.get_args_parser``) with a
``topomesh`` group added (its options match only by full name, so torchrun's
abbreviations keep working), and the launch is torchrun's own ``run(args)`` with the agent
class swapped for :class:`~topomesh.launch.agent.TopologyAgent` during that launch only,
so every torchrun flag, environment variable (``PET_*``), ``@record`` error summary and
exit code behaves as with torchrun. Usage::

    topomesh launch --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \\
        --rdzv-endpoint=head:29400 --rdzv-id=job42 train.py --lr 3e-4

Topology options (before the script name): ``--topology {auto,off,PATH}``,
``--topology-probe``, ``--topology-dir DIR``, ``--topology-form {auto,dense,compact}``,
``--topology-timeout SECONDS``, ``--topology-probe-budget SECONDS``, ``--socket-ifname
{auto,off,NAME}`` (needs the topology agent: nothing is set with ``--topology off``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from topomesh.cli.argtypes import positive_seconds
from topomesh.errors import LaunchError
from topomesh.launch import ifname
from topomesh.topology import api

_MODES = ("auto", "off")


HELP = "torchrun with a topology: every worker gets WORLD_TOPOLOGY_FILE, built during the rendezvous (takes all torchrun flags)."

class _TorchrunParser(argparse.ArgumentParser):
    """torchrun's parser in which topomesh's options match only when spelled in full.

    argparse accepts any unambiguous prefix of a long option (``--t=3`` is ``--tee``).
    Our ``--topology*`` options would make such prefixes of torchrun's options ambiguous,
    so they are left out of prefix matching: every spelling torchrun accepts means the
    same here, and one it refuses is refused here too.
    """

    full_name_only: frozenset[argparse.Action] = frozenset()

    def _get_option_tuples(self, option_string: str) -> list[tuple[Any, ...]]:
        return [t for t in super()._get_option_tuples(option_string) if t[0] not in self.full_name_only]


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with the topology options added (its flags are not re-declared)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.__class__ = _TorchrunParser  # same parser, only prefix matching changes
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
        type=positive_seconds,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for the other nodes' topology after each rendezvous (default 120)",
    )
    group.add_argument(
        "--topology-probe-budget",
        type=positive_seconds,
        default=2.0,
        metavar="SECONDS",
        help="time box for probing one peer node (default 2)",
    )
    group.add_argument(
        "--socket-ifname",
        default=os.environ.get("TOPOMESH_SOCKET_IFNAME", "auto"),
        metavar="{auto,off,NAME}",
        help="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for workers that have none: auto = the "
        "interface that reaches the rendezvous endpoint (default), off = leave them unset, NAME = "
        "this value. A value the user set always wins. Env: TOPOMESH_SOCKET_IFNAME.",
    )
    group.add_argument(
        "--plan",
        default=None,
        metavar="PLAN.json",
        help="a plan written by `topomesh plan -o`: every worker gets TOPOMESH_PLAN pointing at it, "
        "for topomesh.layout.api.mesh_from_plan()",
    )
    parser.full_name_only = frozenset(group._group_actions)  # type: ignore[attr-defined]
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
    directory = args.topology_dir
    if mode is TopologyMode.AUTO and directory and os.path.exists(directory) and not os.path.isdir(directory):
        # fail before the rendezvous rather than in every agent after it
        raise LaunchError(f"--topology-dir {directory!r} is not a directory (a file of that name exists)")
    return TopologyOptions(
        mode=mode,
        path=path,
        directory=args.topology_dir,
        form=api.FileForm(args.topology_form),
        probe=args.topology_probe,
        probe_budget_s=args.topology_probe_budget,
        timeout_s=args.topology_timeout,
        socket_ifname=ifname.check_mode(args.socket_ifname),
        rdzv_host=_rdzv_host(args),
    )


def _rdzv_host(args: argparse.Namespace) -> str | None:
    """The host of the rendezvous endpoint the agents meet at (``--standalone``: this one)."""
    if args.standalone:
        return "localhost"
    if args.rdzv_backend == "static":
        return args.master_addr
    return ifname.rdzv_host_of(args.rdzv_endpoint)


@contextlib.contextmanager
def _agent_class(factory: Any) -> Iterator[None]:
    """Make ``launch_agent`` build our agent for this launch only.

    ``torch.distributed.launcher.api.launch_agent`` instantiates the module-level name
    ``LocalElasticAgent``; whatever is there on entry (torch's class, or a wrapper a test
    harness or plugin installed) is put back on exit, also when the launch raises.
    """
    import torch.distributed.launcher.api as launcher_api

    from topomesh.launch.agent import check_hooks

    check_hooks()
    saved = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = factory
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = saved


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``topomesh launch ARGS`` in this process, like torchrun's ``main(args)``.

    Returns when every worker succeeded. A failed worker raises torchrun's
    ``ChildFailedError`` after ``@record`` wrote the error file, exactly as
    ``torch.distributed.run.main`` does; bad input raises a
    :class:`~topomesh.errors.TopomeshError`. ``--topology off`` runs torchrun's ``run``
    with nothing of topomesh installed.
    """
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run

    from topomesh.launch.agent import TopologyMode, agent_factory

    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    options = options_from_args(args)
    if options.mode is TopologyMode.OFF and getattr(args, "numa_binding", None) and not _cuda():
        # torchrun's own binding asks CUDA for each worker's GPU and fails in every worker
        raise LaunchError(f"--numa-binding {args.numa_binding} without CUDA binds workers from the discovered "
                          "topology: give --topology auto (the default) or a file, not --topology off")
    if args.plan:
        from topomesh.layout.api import PLAN_ENV_VAR, read_plan

        read_plan(args.plan)  # fail before any process starts
        os.environ[PLAN_ENV_VAR] = os.path.abspath(args.plan)  # workers inherit the agent's environment

    @record
    def launch() -> None:
        if options.mode is TopologyMode.OFF:
            run(args)
            return
        with _agent_class(agent_factory(options)):
            run(args)

    launch()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def command(argv: Sequence[str]) -> int:
    """``topomesh launch`` on the command line: the exit code torchrun's gives.

    0 when every worker succeeded; 1 when one failed, with the last lines torchrun prints
    for the ``ChildFailedError`` it lets escape (the exception's name and its failure
    summary; log alerts match on them), without the traceback. Bad input is raised for
    the ``topomesh`` command to print as one line (exit code 2). A closed stderr
    (``... 2>&1 | head -1``) never turns a failure into success.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        main(argv)
    except ChildFailedError as exc:
        say("".join(traceback.format_exception_only(exc)).rstrip("\n"))
        return 1
    except BrokenPipeError:
        # something of ours or torchrun's wrote to a closed pipe before the job ended
        quiet_stdio()
        return 1
    return 0


def say(line: str) -> None:
    """Print ``line`` on stderr; when stderr is a closed pipe, drop it (the exit code still
    tells the outcome) and keep the interpreter from failing at exit over it."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stderr already closed
        quiet_stdio()


def quiet_stdio() -> None:
    """Point stdout and stderr at /dev/null, so flushing them at exit cannot raise again
    (Python's advice for ``BrokenPipeError``, docs of the ``signal`` module)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(devnull, stream.fileno())
    os.close(devnull)
