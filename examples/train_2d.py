"""2-D parallel training (tensor parallel inside pipeline stages) on a topomesh layout.

The mesh comes from :func:`topomesh.layout.api.mesh_from_topology`: it reads
``WORLD_TOPOLOGY_FILE`` (set by ``topomesh launch``), places the layout so TP groups sit
inside NVLink islands and PP crosses hosts, and builds a ``DeviceMesh("pp", "tp")``.
Everything else is PyTorch's own API:

* TP + sequence parallel with DTensor: ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput`` (torchtitan's plan);
* PP with ``torch.distributed.pipelining``: one ``PipelineStage`` per pp rank and
  ``ScheduleGPipe`` or ``Schedule1F1B``.

Run on CPU (gloo), 4 processes, pp=2 × tp=2::

    topomesh launch --standalone --nproc-per-node 4 examples/train_2d.py --steps 3

``--out DIR`` saves every step's loss and full gradients (``DIR/rank<r>.pt``, written by
the tp-rank-0 of each stage); ``reference_run`` computes the same on one process, which is
what ``tests/examples/test_train_2d.py`` compares.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    vocab: int = 64
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 4
    seq: int = 8
    batch: int = 4
    microbatches: int = 2
    lr: float = 0.1
    seed: int = 0


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # heads from the local width, so the same code runs on a TP shard
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.w2 = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """A small decoder; a pipeline stage is this module with the other stages' parts removed."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: nn.Module | None = nn.RMSNorm(cfg.dim)
        self.output: nn.Module | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(cfg: Config) -> Transformer:
    torch.manual_seed(cfg.seed)
    return Transformer(cfg)


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and next-token targets of one step; the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def reference_run(cfg: Config, steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process, no parallelism: per step the mean microbatch loss and every gradient.

    The pipeline schedule sums microbatch gradients and divides by their number
    (``scale_grads=True``), which is the gradient of the mean microbatch loss.
    """
    model = build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(cfg, step)
        opt.zero_grad()
        mb = [loss_fn(model(xs), ys) for xs, ys in zip(x.chunk(cfg.microbatches), y.chunk(cfg.microbatches), strict=True)]
        loss = torch.stack(mb).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads


def stage_model(model: Transformer, stage: int, num_stages: int) -> Transformer:
    """Keep this stage's contiguous share of layers; embeddings first, norm and output last."""
    n = len(model.layers)
    if n % num_stages:
        raise ValueError(f"{num_stages} pipeline stages do not divide {n} layers")
    per = n // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model


def parallelize(model: Transformer, tp_mesh, *, sequence_parallel: bool = True) -> Transformer:
    """torchtitan-style TP (+SP) plan; activations between blocks are sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        top["norm"] = SequenceParallel() if sequence_parallel else None
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if v is not None})
    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    return model


def train(args: argparse.Namespace, *, destroy: bool = True) -> dict[str, object]:
    """Train ``args.steps`` steps on this rank; returns its record (losses, gradients, mesh).

    ``destroy=False`` leaves the process group to whoever created it (Ray Train).
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import DTensor

    from topomesh.layout.api import job_topology, mesh_from_topology, place_layout
    from topomesh.layout.place import axis_report

    torch.set_num_threads(1)
    cfg = Config()
    degrees = {"pp": args.pp, "tp": args.tp}
    mesh = mesh_from_topology(degrees, device_type=args.device)
    if dist.get_rank() == 0:
        topo = job_topology(None, dist.get_world_size())
        placement = place_layout(degrees, topology=topo, world_size=dist.get_world_size())
        for rep in axis_report(topo, placement):
            print(f"{rep.axis.value}={rep.degree}: groups {placement.groups(rep.axis)} cross {rep.kind.value} "
                  f"({rep.bottleneck_GBps:g} GB/s) [{topo.source}]", flush=True)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    stage, num_stages = mesh.get_local_rank("pp"), mesh.size(mesh.mesh_dim_names.index("pp"))
    tp_rank = mesh.get_local_rank("tp")
    model = parallelize(stage_model(build_model(cfg).to(device), stage, num_stages), mesh["tp"],
                        sequence_parallel=not args.no_sequence_parallel)
    pipe_stage = PipelineStage(model, stage, num_stages, device, group=mesh.get_group("pp"))
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = schedule_cls(pipe_stage, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    last = stage == num_stages - 1
    record: dict[str, object] = {
        "stage": stage,
        "tp": tp_rank,
        "mesh": mesh.mesh.tolist(),
        "topology_file": os.environ.get("WORLD_TOPOLOGY_FILE"),
        "losses": [],
        "grads": [],
        "step_s": [],
    }
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(cfg, step))
        opt.zero_grad()
        t0 = time.perf_counter()
        losses: list[torch.Tensor] = []
        if stage == 0:
            schedule.step(x, target=y if last else None, losses=losses if last else None)
        else:
            schedule.step(target=y if last else None, losses=losses if last else None)
        record["step_s"].append(time.perf_counter() - t0)
        grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu()
                 for n, p in model.named_parameters()}
        opt.step()
        if last:
            loss = torch.stack([loss.detach() for loss in losses]).mean().item()
            record["losses"].append(loss)
            if tp_rank == 0:
                print(f"step {step + 1} loss {loss:.6f} ({record['step_s'][-1] * 1e3:.1f} ms)", flush=True)
        record["grads"].append(grads)
    if args.out and tp_rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save(record, Path(args.out) / f"rank{dist.get_rank()}.pt")
    if destroy:
        dist.destroy_process_group()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-sequence-parallel", action="store_true")
    p.add_argument("--out", default=None, help="directory for per-rank losses and gradients")
    return p.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
