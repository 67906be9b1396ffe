"""Train a built-in model on the layout ``topomesh plan`` chose: the mesh comes from the plan
(:func:`topomesh.layout.api.mesh_from_plan`, ``TOPOMESH_PLAN`` set by ``topomesh launch --plan``),
the model is parallelized by topomesh's own parallelize function (TP/SP, FSDP2, EP with
PyTorch's APIs) over that mesh, and a few AdamW steps run on random tokens.

    topomesh plan --model tiny-llama --topology world.json --device cpu --strategies tp,dp_shard -o plan.json
    topomesh launch --standalone --nproc-per-node 2 --plan plan.json examples/train_plan.py --steps 3

Layouts with a pipeline (pp > 1) need a pipeline schedule around the model (see
examples/train_2d.py); this example refuses them in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel


def main() -> None:
    from topomesh.layout.api import mesh_from_plan, read_plan
    from topomesh.models.parallelize import ParallelOptions, parallelize_transformer
    from topomesh.models.presets import get_preset
    from topomesh.models.transformer import Transformer
    from topomesh.trace.tracer import causal_lm_loss

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    plan = read_plan()
    best = plan["best"]
    if best is None:
        raise SystemExit("train_plan: the plan has no feasible layout")
    degrees = best["layout"]["degrees"]
    if degrees.get("pp", 1) > 1:
        raise SystemExit("train_plan: pp > 1 needs a pipeline schedule (see examples/train_2d.py)")
    mesh = mesh_from_plan(device_type="cpu")
    rank = dist.get_rank()
    cfg = get_preset(plan["inputs"]["model"])
    torch.manual_seed(0)  # the same initial weights on every rank
    model = parallelize_transformer(Transformer(cfg), mesh, ParallelOptions(
        sequence_parallel=best["layout"]["sequence_parallel"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = mesh.mesh_dim_names or ()
    dp_dims = [n for n in ("dp_replicate", "dp_shard") if n in names]
    dp = 1
    dp_index = 0
    for n in dp_dims:  # this rank's data-parallel replica: slowest dim first
        dp_index = dp_index * mesh[n].size() + mesh.get_local_rank(n)
        dp *= mesh[n].size()
    batch = best["layout"]["micro_batch"]
    for step in range(args.steps):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step)  # the global batch, the same on every rank
        tokens = torch.randint(0, cfg.vocab_size, (dp * batch, cfg.seq_len), generator=g)
        mine = tokens[dp_index * batch:(dp_index + 1) * batch]
        out = model(mine)
        with loss_parallel() if isinstance(out, DTensor) else contextlib.nullcontext():  # vocab-sharded logits
            loss = causal_lm_loss(out, mine)
            loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()
        if rank == 0:
            print(f"step {step}: loss {value.item():.4f} ({time.perf_counter() - t0:.2f} s) on "
                  f"{dict(zip(names, mesh.mesh.shape, strict=True))}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
