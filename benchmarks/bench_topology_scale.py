"""Scale of the launcher's topology: 16,384 ranks = 2,048 DGX H100 hosts x 8 GPUs.

The host comes from the fixture sysfs tree (discovered once) and is replicated under
2,048 host names, as the rendezvous would see them. Measured, each the best of
``--repeat`` runs:

* exchange: the leader validating 2,048 node entries (and the one host class they share)
  and assembling the world document
  (what ``topomesh launch`` does after each rendezvous), and every node decoding it;
* build: ``build_topology`` for the whole world;
* write: ``api.dumps`` (auto form: compact above 128 ranks) + ``write_atomic``; file size;
* read: ``api.read_source`` of the written file;
* lookup: ``Topology.connection(a, b)`` for random pairs at 1,024 and 16,384 ranks
  (O(1): the per-lookup time must not grow with the world).

Usage: ``python benchmarks/bench_topology_scale.py [--hosts 2048] [--gpus 8] [--json]``
Targets (issue 3): build + write <= 2 s, file <= 2 MB.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from topomesh.launch import exchange
from topomesh.topology import api
from topomesh.topology.build import build_topology
from topomesh.topology.discover import discover_host
from topomesh.topology.model import Host, Topology

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "sysfs" / "dgx-h100-8gpu-8ib"


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def world_entries(host: Host, hosts: int, gpus: int) -> list[exchange.NodeEntry]:
    return [
        exchange.NodeEntry(
            group_rank=h,
            host=host.renamed(f"node{h:05d}"),
            workers=tuple(
                exchange.WorkerSlot(global_rank=h * gpus + i, local_rank=i, device=f"GPU{i}") for i in range(gpus)
            ),
        )
        for h in range(hosts)
    ]


def lookup_ns(topo: Topology, n: int = 200_000, seed: int = 0) -> float:
    rng = random.Random(seed)
    w = topo.world_size
    pairs = [(rng.randrange(w), rng.randrange(w)) for _ in range(n)]
    conn = topo.connection
    t0 = time.perf_counter()
    for a, b in pairs:
        conn(a, b)
    return (time.perf_counter() - t0) / n * 1e9


def run(hosts: int, gpus: int, repeat: int) -> dict[str, Any]:
    host = discover_host(FIXTURE)
    entries = world_entries(host, hosts, gpus)
    blobs = [exchange.encode_node(e) for e in entries]
    published = dict([exchange.host_class(e.host) for e in entries])  # one class for all
    def lead() -> bytes:
        classes = exchange.HostClasses(lambda d, g: published[d])
        return exchange.assemble_world(
            [exchange.decode_node(b, group_rank=g, classes=classes) for g, b in enumerate(blobs)]
        )

    t_leader, doc = best_of(repeat, lead)
    t_decode, world = best_of(repeat, lambda: exchange.decode_world(doc))
    t_build, topo = best_of(repeat, lambda: build_topology(world.hosts, world.ranks, run_id="bench", restart_count=0))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "topology.json"
        t_write, _ = best_of(repeat, lambda: api.write_atomic(path, api.dumps(topo)))
        size = path.stat().st_size
        t_read, back = best_of(repeat, lambda: api.read_source(path))
    rng = random.Random(1)
    for _ in range(1000):
        a, b = rng.randrange(topo.world_size), rng.randrange(topo.world_size)
        assert back.connection(a, b) == topo.connection(a, b)
    small = build_topology(world.hosts[: max(1, 1024 // gpus)], world.ranks[: (1024 // gpus) * gpus])
    # --topology-probe: the ring of node pairs and every local GPU pair measured. The figures
    # are random (measurements differ from node to node, so each is its own connection);
    # the shape of the overrides is a real probe round's.
    fig = random.Random(2)
    ring = {tuple(sorted((h, (h + 1) % hosts))): (fig.uniform(3, 8), fig.uniform(30, 45))
            for h in range(hosts) if hosts > 1}
    gpu_ids = [d.id for d in host.gpus][:gpus]
    local = {
        h: tuple((a, b, fig.uniform(8, 20), fig.uniform(250, 350)) for i, a in enumerate(gpu_ids) for b in gpu_ids[i + 1:])
        for h in range(hosts)
    }

    def probed() -> Topology:
        return build_topology(world.hosts, world.ranks, measured_hosts=ring, measured_devices=local,
                              run_id="bench", restart_count=0)

    t_probed_build, probed_topo = best_of(repeat, probed)
    t_probed_dumps, probed_text = best_of(repeat, lambda: api.dumps(probed_topo))
    probed_back = api.parse_text(probed_text)
    for _ in range(1000):
        a, b = rng.randrange(topo.world_size), rng.randrange(topo.world_size)
        assert probed_back.connection(a, b) == probed_topo.connection(a, b)
    return {
        "ranks": topo.world_size,
        "hosts": hosts,
        "node_entry_bytes": len(blobs[0]),
        "host_class_bytes": len(next(iter(published.values()))),
        "host_classes": len(published),
        "world_document_bytes": len(doc),
        "leader_validate_assemble_s": round(t_leader, 4),
        "node_decode_world_s": round(t_decode, 4),
        "build_s": round(t_build, 4),
        "write_s": round(t_write, 4),
        "build_plus_write_s": round(t_build + t_write, 4),
        "file_bytes": size,
        "file_form": api.FileForm.DENSE.value if topo.world_size <= api.DENSE_MAX_RANKS else api.FileForm.COMPACT.value,
        "read_s": round(t_read, 4),
        "lookup_ns_1k_ranks": round(lookup_ns(small), 1),
        "lookup_ns_16k_ranks": round(lookup_ns(topo), 1),
        "lookup_ns_16k_ranks_read_back": round(lookup_ns(back), 1),
        "probed_measurements": len(ring) + sum(len(r) for r in local.values()),
        "probed_build_s": round(t_probed_build, 4),
        "probed_write_text_s": round(t_probed_dumps, 4),
        "probed_build_plus_text_s": round(t_probed_build + t_probed_dumps, 4),
        "probed_file_bytes": len(probed_text.encode()),
        "probed_lookup_ns_16k_ranks": round(lookup_ns(probed_topo), 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=2048)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = run(a.hosts, a.gpus, a.repeat)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        width = max(map(len, res))
        for k, v in res.items():
            print(f"{k:<{width}}  {v}")
        ok = res["build_plus_write_s"] <= 2.0 and res["file_bytes"] <= 2_000_000
        print(f"targets (build+write <= 2 s, file <= 2 MB): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
