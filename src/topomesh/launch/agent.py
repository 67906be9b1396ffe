"""torchrun's ``LocalElasticAgent`` that builds the world topology after every rendezvous.

Two private hooks of torch's elastic agent are used (checked at import, see
:func:`check_hooks`):

* ``SimpleElasticAgent._rendezvous(worker_group)`` — after it returns, the worker group
  knows its store (with c10d a ``PrefixStore`` scoped to the run id and round), its
  ``group_rank``/``group_world_size`` and every worker's ``global_rank``. The agent
  publishes its node entry, the leader assembles the world, every agent writes the file.
* ``LocalElasticAgent._set_local_rank_env(worker_env, local_rank, spec)`` — called once
  per worker with that worker's environment: ``WORLD_TOPOLOGY_FILE`` is set there.

Restarts and membership changes both go through ``_rendezvous``, so the file is rebuilt
for every round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from topomesh.errors import LaunchError
from topomesh.launch import exchange, ifname, localprobe, numa, probe
from topomesh.launch.files import run_directory, write_topology_file
from topomesh.launch.local import discover_local_host, local_devices, visible_devices
from topomesh.topology import api
from topomesh.topology.build import build_topology
from topomesh.topology.model import Host

log = logging.getLogger("topomesh.launch")

TESTED_TORCH = "2.13"
MAX_MISSING_ROUNDS = 3
"""Rendezvous rounds in a row the agent re-forms because a node published nothing."""
TEST_HOLD_ENV = "TOPOMESH_TEST_HOLD_EXCHANGE_S"
"""Test hook: seconds an agent sleeps after each rendezvous before publishing its entry,
so a test can kill it inside the exchange. Unset in real jobs."""


def check_hooks() -> None:
    """Fail with a clear sentence when the private torchrun hooks this agent needs are gone."""
    import torch.distributed.launcher.api as launcher_api

    problems = []
    if not callable(getattr(SimpleElasticAgent, "_rendezvous", None)):
        problems.append("SimpleElasticAgent._rendezvous")
    hook = getattr(LocalElasticAgent, "_set_local_rank_env", None)
    if not callable(hook):
        problems.append("LocalElasticAgent._set_local_rank_env")
    elif list(inspect.signature(hook).parameters)[:4] != ["self", "worker_env", "local_rank", "spec"]:
        problems.append("LocalElasticAgent._set_local_rank_env(worker_env, local_rank, spec)")
    # launch_agent instantiates this name; it may hold a wrapper someone else installed,
    # which is theirs to do: only its absence means the hook point is gone
    if not callable(getattr(launcher_api, "LocalElasticAgent", None)):
        problems.append("torch.distributed.launcher.api.LocalElasticAgent")
    if problems:
        raise LaunchError(
            f"torch {torch.__version__} lacks the torchrun internals topomesh launch hooks into "
            f"({', '.join(problems)}); it was tested with torch {TESTED_TORCH}. "
            "Use plain torchrun, or a torch version topomesh supports."
        )


check_hooks()


class TopologyMode(StrEnum):
    AUTO = "auto"  # discover every node, exchange, build
    OFF = "off"  # plain torchrun
    FILE = "file"  # a file someone gave, passed through


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyOptions:
    """The ``--topology*`` options of ``topomesh launch``."""

    mode: TopologyMode = TopologyMode.AUTO
    path: str | None = None
    """The given file when ``mode`` is ``FILE`` (absolute)."""
    directory: str | None = None
    """Base directory for written files; default ``$TMPDIR/topomesh-<uid>``."""
    form: api.FileForm = api.FileForm.AUTO
    probe: bool = False
    probe_budget_s: float = 2.0
    """Time box for measuring one peer node."""
    timeout_s: float = 120.0
    """How long to wait for peers' entries and the leader's world after a rendezvous."""
    socket_ifname: str = ifname.AUTO
    """``auto``, ``off`` or an interface name for NCCL/Gloo sockets (:mod:`topomesh.launch.ifname`)."""
    rdzv_host: str | None = None
    """The rendezvous endpoint's host, which ``auto`` finds the interface towards (default:
    the workers' ``MASTER_ADDR``)."""

    def __post_init__(self) -> None:
        if (self.mode is TopologyMode.FILE) != (self.path is not None):
            raise LaunchError("a topology file path is given exactly when the topology mode is 'file'")
        if self.timeout_s <= 0 or self.probe_budget_s <= 0:
            raise LaunchError(
                f"topology timeouts must be positive, got {self.timeout_s} s and {self.probe_budget_s} s"
            )


class TopologyAgent(LocalElasticAgent):
    """``LocalElasticAgent`` plus a topology file per rendezvous round."""

    def __init__(self, *args: Any, topology: TopologyOptions, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._topology = topology
        self._topology_file: str | None = None  # this round's WORLD_TOPOLOGY_FILE
        self._host: Host | None = None
        self._local_probes: dict[tuple[str | None, ...], tuple[tuple[str, str, float, float], ...]] = {}
        self._rounds = 0
        self._ifname: str | None = None
        self._ifname_chosen = False
        self._bindings: list[numa.Binding | None] = []  # this round's, by local rank (ours only)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._choose_ifname(worker_group)
        self._bindings = []
        self._bindings = self._plan_numa(worker_group)
        self._topology_file = None
        if self._topology.mode is TopologyMode.OFF:
            return
        t0 = time.perf_counter()
        lost = 0
        while True:
            try:
                path = self._round_file(worker_group)
                break
            except exchange.PeerMissingError as exc:
                # A node lost right after the rendezvous: torchrun would notice it later and
                # re-form without it; do that now instead of failing the job. Not a restart
                # (torchrun does not count membership changes), but bounded, so a peer that
                # is alive and never publishes (plain torchrun) still ends in an error.
                # The static backend cannot form a round without the lost node.
                if lost >= MAX_MISSING_ROUNDS or worker_group.spec.rdzv_handler.get_backend() == "static":
                    raise
                lost += 1
                log.warning("topomesh: %s; re-forming the rendezvous without it (%d of %d)", exc, lost, MAX_MISSING_ROUNDS)
                super()._rendezvous(worker_group)
        self._rounds += 1
        self._topology_file = str(path)
        log.info("topomesh: %s for round %d (%.3f s)", path, self._rounds - 1, time.perf_counter() - t0)

    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        if self._topology_file is not None:
            worker_env[api.ENV_VAR] = self._topology_file
        worker_env.update(ifname.worker_env(self._ifname, {**os.environ, **{k: v for k, v in worker_env.items() if v}}))
        binding = self._bindings[local_rank] if local_rank < len(self._bindings) else None
        if binding is not None:
            worker_env[numa.ENV_VAR] = numa.cpulist(binding.cpus)

    def _start_workers(self, worker_group: WorkerGroup) -> Any:
        if self._bindings:  # we bind: start each worker through topomesh.launch.bind
            spec = worker_group.spec
            if isinstance(spec.entrypoint, str) and spec.args[:2] != ("-m", "topomesh.launch.bind"):
                spec.args = ("-m", "topomesh.launch.bind", spec.entrypoint, *spec.args)
                spec.entrypoint = sys.executable
            spec.numa_options = None  # torch's binding needs CUDA, which this agent lacks
        return super()._start_workers(worker_group)

    def _local_host(self) -> Host:
        """This node, discovered once, with its socket interface and this round's worker bindings."""
        if self._host is None:
            self._host = discover_local_host()
        bindings = tuple((i, b.numa_node, numa.cpulist(b.cpus)) for i, b in enumerate(self._bindings) if b)
        if (self._host.socket_ifname, self._host.numa_bindings) != (self._ifname, bindings):
            self._host = dataclasses.replace(self._host, socket_ifname=self._ifname, numa_bindings=bindings)
        return self._host

    def _plan_numa(self, wg: WorkerGroup) -> list[numa.Binding | None]:
        """Bindings from the topology when ``--numa-binding`` is on and torch's own (CUDA) does
        not apply; empty when torch binds or nobody asked."""
        options = getattr(wg.spec, "numa_options", None)
        if options is None or not isinstance(wg.spec.entrypoint, str):
            return []
        host = self._local_host()
        if torch.cuda.is_available() and host.gpus:
            return []  # torch's implementation: worker i on the NUMA node of cuda:i
        from topomesh.topology.discover import ENV_SYSFS_ROOT, read_numa_nodes

        mode = numa.BindMode(str(getattr(options.affinity_mode, "value", options.affinity_mode)))
        devices = local_devices(host, wg.spec.local_world_size, visible_devices())
        plan = numa.plan(host, devices, read_numa_nodes(os.environ.get(ENV_SYSFS_ROOT) or "/"), mode,
                          os.sched_getaffinity(0))
        if mode in (numa.BindMode.SOCKET, numa.BindMode.CORE_COMPLEX):
            log.warning("topomesh: --numa-binding %s needs socket/L3 data the topology lacks; binding to NUMA nodes", mode)
        for i, b in enumerate(plan):
            where = f"NUMA node {b.numa_node}, CPUs {numa.cpulist(b.cpus)}" if b else "unbound (NUMA node unknown)"
            log.info("topomesh: local rank %d (%s): %s", i, devices[i] or "no device", where)
        return plan

    def _choose_ifname(self, wg: WorkerGroup) -> None:
        """Once per agent: the interface that reaches the rendezvous host (``--socket-ifname``)."""
        if self._ifname_chosen:
            return
        self._ifname_chosen = True
        opt = self._topology.socket_ifname
        target = self._topology.rdzv_host or wg.master_addr
        try:
            self._ifname = ifname.choose(opt, target)
        except LaunchError as exc:
            log.warning("topomesh: %s; NCCL/Gloo choose their own interface", exc)
            return
        given = [v for v in ifname.ENV_VARS if v in os.environ]
        if self._ifname is None:
            if opt == ifname.AUTO:
                log.warning("topomesh: no local interface holds the address that reaches %s; "
                            "NCCL/Gloo choose their own interface", target)
        else:
            how = f"reaches the rendezvous host {target}" if opt == ifname.AUTO else "given"
            kept = f"; kept the user's {', '.join(given)}" if given else ""
            # info, not warning: launch output stays torchrun's (the choice is in the file too)
            log.info("topomesh: workers' socket interface %s (%s)%s", self._ifname, how, kept)

    # -- one round --------------------------------------------------------------------

    def _round_file(self, wg: WorkerGroup) -> Path:
        world_size = wg.workers[0].world_size if wg.workers else 0
        if self._topology.mode is TopologyMode.FILE:
            assert self._topology.path is not None
            topo = api.read_source(self._topology.path)
            if topo.world_size != world_size:
                raise LaunchError(
                    f"topology file {self._topology.path!r} describes {topo.world_size} ranks, "
                    f"but this round has WORLD_SIZE={world_size}"
                )
            return Path(self._topology.path)
        spec = wg.spec
        run_id = spec.rdzv_handler.get_run_id()
        host = self._local_host()
        devs = local_devices(host, spec.local_world_size, visible_devices())
        slots = tuple(
            exchange.WorkerSlot(global_rank=w.global_rank, local_rank=w.local_rank, device=devs[w.local_rank])
            for w in wg.workers
        )
        # c10d/etcd stores are scoped to the round; the static store is not, so its keys
        # carry this agent's round number (static worlds restart all nodes together).
        ns = f"topomesh/{self._rounds}" if spec.rdzv_handler.get_backend() == "static" else "topomesh"
        store = wg.store
        entry_kw = dict(
            group_rank=wg.group_rank,
            host=host,
            workers=slots,
            restart_count=spec.max_restarts - self._remaining_restarts,
            local_measured=self._probe_local(host, [s.device for s in slots]) if self._topology.probe else (),
        )
        hold_s = os.environ.get(TEST_HOLD_ENV)
        if hold_s:
            log.warning("topomesh: holding the exchange for %s s (%s)", hold_s, TEST_HOLD_ENV)
            time.sleep(float(hold_s))
        if self._topology.probe and wg.group_world_size > 1:
            with contextlib.ExitStack() as stack:
                addr = None
                try:
                    bind = probe.local_address_towards(wg.master_addr or "127.0.0.1")
                    addr = stack.enter_context(probe.ProbeServer(bind)).address
                except OSError as exc:
                    log.warning("topomesh: cannot start the probe server (%s); peers will not measure this node", exc)
                exchange.publish_node(store, ns, exchange.NodeEntry(**entry_kw, probe_addr=addr))
                self._probe_next(store, ns, wg)
                world = self._leader_and_world(store, ns, wg, probing=True)
        else:
            exchange.publish_node(store, ns, exchange.NodeEntry(**entry_kw))
            world = self._leader_and_world(store, ns, wg, probing=False)
        mine = sorted((r.rank, r.local_rank) for r in world.ranks if r.host == wg.group_rank)
        if mine != sorted((w.global_rank, w.local_rank) for w in wg.workers):
            raise LaunchError(f"the world document places other ranks on node {wg.group_rank} than torchrun did")
        topo = build_topology(
            world.hosts,
            world.ranks,
            measured_hosts=world.measured,
            measured_devices=world.local_measured,
            run_id=run_id,
            restart_count=world.restart_count,
            source="rendezvous",
        )
        text = api.dumps(topo, self._topology.form)
        return write_topology_file(run_directory(run_id, self._topology.directory), text, world.restart_count)

    def _probe_local(self, host: Host, devices: list[str | None]) -> tuple[tuple[str, str, float, float], ...]:
        """Measured links between this node's devices; once per set of devices (rounds reuse it)."""
        key = tuple(devices)
        if key not in self._local_probes:
            try:
                got = localprobe.measure_local(host, devices, budget_s=self._topology.probe_budget_s)
                self._local_probes[key] = tuple((r.device_a, r.device_b, r.latency_us, r.bandwidth_GBps) for r in got)
            except Exception as exc:  # best effort: a probe never stops the job
                log.warning("topomesh: local probe failed, keeping default link values inside this node: %s", exc)
                self._local_probes[key] = ()
        return self._local_probes[key]

    def _probe_next(self, store: Any, ns: str, wg: WorkerGroup) -> None:
        """Measure node ``group_rank + 1`` (mod n) and publish the result (or the failure)."""
        peer = (wg.group_rank + 1) % wg.group_world_size
        result: dict[str, Any] = {"peer": peer}
        try:
            blob = exchange.wait_for(store, exchange.node_key(ns, peer), self._topology.timeout_s, what=f"node {peer}")
            classes = exchange.HostClasses(
                lambda d, g: exchange.wait_for(store, exchange.class_key(ns, d), self._topology.timeout_s, what=f"node {g}")
            )
            entry = exchange.decode_node(blob, group_rank=peer, classes=classes)
            if entry.probe_addr is None:
                raise LaunchError(f"node {peer} runs no probe server")
            got = probe.measure(entry.probe_addr, budget_s=self._topology.probe_budget_s)
            result.update(latency_us=got.latency_us, bandwidth_GBps=got.bandwidth_GBps)
        except LaunchError as exc:
            log.warning("topomesh: probe of node %d failed, keeping default link values: %s", peer, exc)
        store.set(exchange.probe_key(ns, wg.group_rank), json.dumps(result))

    def _leader_and_world(self, store: Any, ns: str, wg: WorkerGroup, *, probing: bool) -> exchange.World:
        opts = self._topology
        if wg.group_rank == 0:
            exchange.lead(
                store, ns, wg.group_world_size, opts.timeout_s, probe_timeout_s=opts.timeout_s + opts.probe_budget_s if probing else None
            )
        return exchange.fetch_world(store, ns, opts.timeout_s + (opts.probe_budget_s if probing else 0))


def agent_factory(options: TopologyOptions) -> Any:
    """What ``torch.distributed.launcher.api`` calls in place of ``LocalElasticAgent``
    during one launch (installed and removed by ``topomesh.launch.cli``)."""

    def make(*args: Any, **kwargs: Any) -> TopologyAgent:
        return TopologyAgent(*args, topology=options, **kwargs)

    return make

