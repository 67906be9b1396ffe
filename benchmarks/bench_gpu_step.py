"""Where one GPU's training step goes: kernel time, the GPU's idle gaps, and time per op.

    python benchmarks/bench_gpu_step.py --model benchmarks/validate_gpu_llama.json --micro-batch 2 --out step.json

The step ``topomesh validate --device cuda`` measures (the reference transformer in the
training dtype, the micro-batches one after the other, AdamW one parameter at a time), run
``--warmup`` times, then ``--steps`` times under ``torch.profiler`` with CPU and CUDA
activity. For each profiled step it records the wall time (``torch.cuda.synchronize`` at both
ends) and the time some kernel ran (the union of the kernels' intervals): what is left is
the GPU waiting for the host to issue work, which an op table of isolated kernel times does
not hold. Per aten op it records the calls and the device time of the kernels it launched
(``self_device_time_total`` of ``key_averages``), to set against the op table's times of
the same ops (``topomesh validate --db``). Needs a CUDA device; prints a summary and writes
``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of (start, end) intervals.

    >>> _busy_ns([(0, 10), (5, 20), (30, 40)])
    30
    """
    busy, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from topomesh.models.transformer import Transformer
    from topomesh.sim.inputs import load_model
    from topomesh.sim.simulate import DTYPES
    from topomesh.trace.tracer import default_optimizer
    from topomesh.validate.worker import _plain_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="benchmarks/validate_gpu_llama.json")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--device", default="cuda", help="cuda (default); cpu only checks that the script runs")
    args = p.parse_args()
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu_step: needs a CUDA device")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    model_def = load_model(args.model)
    cfg = dataclasses.replace(model_def.config, seq_len=model_def.seq_len)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with dev:
            module = Transformer(cfg)
    finally:
        torch.set_default_dtype(previous)
    optimizer = default_optimizer(list(module.parameters()))
    step_fn = _plain_step(module, args.microbatches)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch * args.microbatches, cfg.seq_len),
                           generator=torch.Generator().manual_seed(1)).to(dev)

    def one_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        step_fn(tokens)
        optimizer.step()

    def marked_step() -> list[tuple[str, float, object]]:
        """``one_step`` with a (name, host time, CUDA event) at the start of each phase and at
        its end: where the host is while the GPU reaches each mark."""
        from topomesh.trace.tracer import causal_lm_loss

        marks = []

        def mark(name: str) -> None:
            ev = torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else None
            if ev is not None:
                ev.record()
            marks.append((name, time.perf_counter(), ev))

        mark("zero_grad")
        optimizer.zero_grad(set_to_none=True)
        for i, chunk in enumerate(tokens.chunk(args.microbatches)):
            mark(f"forward {i}")
            loss = causal_lm_loss(module(chunk), chunk)
            mark(f"backward {i}")
            loss.backward()
        mark("optimizer")
        optimizer.step()
        mark("issued")
        sync()
        mark("end")
        return marks

    for _ in range(args.warmup):
        one_step()
    sync()
    plain = []
    for _ in range(args.steps):  # unprofiled, for the profiler's own cost
        t0 = time.perf_counter()
        one_step()
        sync()
        plain.append(time.perf_counter() - t0)
    phases: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.steps):  # host and GPU time between phase marks
        marks = marked_step()
        for (name, h0, e0), (_, h1, e1) in zip(marks, marks[1:], strict=False):
            row = phases.setdefault(name, {"host_s": [], "gpu_s": []})
            row["host_s"].append(h1 - h0)
            if e0 is not None:
                row["gpu_s"].append(e0.elapsed_time(e1) / 1e3)
    phases = {k: {kk: statistics.median(vv) if vv else None for kk, vv in v.items()} for k, v in phases.items()}
    walls = []
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if dev.type == "cuda" else [])]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            one_step()
            sync()
            walls.append(time.perf_counter() - t0)
    kernels = [(int(e.time_range.start * 1000), int(e.time_range.end * 1000)) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_s = _busy_ns(kernels) / 1e9 / args.steps  # time_range is in microseconds
    ops = {}
    for a in prof.key_averages():
        dev_us = getattr(a, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(a, "self_cuda_time_total", 0.0)
        if a.key.startswith("aten::") and dev_us > 0:
            ops[a.key] = {"calls": a.count // args.steps, "device_ms": round(dev_us / 1e3 / args.steps, 4),
                          "cpu_ms": round(a.self_cpu_time_total / 1e3 / args.steps, 4)}
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]["device_ms"]))
    out = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__, "model": cfg.name,
        "micro_batch": args.micro_batch, "microbatches": args.microbatches, "dtype": args.dtype,
        "step_s": plain, "profiled_step_s": walls, "kernel_busy_s": busy_s,
        "kernels_per_step": len(kernels) // args.steps, "phases": phases, "ops": ops,
        "max_memory_allocated": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
    }
    med = statistics.median(plain)
    print(f"{out['device']}: step {med * 1e3:.2f} ms (median of {len(plain)}), profiled "
          f"{statistics.median(walls) * 1e3:.2f} ms, kernels busy {busy_s * 1e3:.2f} ms a step "
          f"({out['kernels_per_step']} kernels): the GPU idles {(statistics.median(walls) - busy_s) * 1e3:.2f} ms")
    for name, row in phases.items():
        gpu = "-" if row["gpu_s"] is None else f"{row['gpu_s'] * 1e3:8.2f}"
        print(f"  phase {name:14s} host {row['host_s'] * 1e3:8.2f} ms, GPU between its marks {gpu} ms")
    for name, row in list(ops.items())[:15]:
        print(f"  {name:48s} {row['calls']:5d} calls {row['device_ms']:9.3f} ms device {row['cpu_ms']:8.3f} ms host")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
