"""The inputs ``simulate`` (and later ``plan`` and ``validate``) share: model, cluster, layout
and training knobs, with the same flag names everywhere (DESIGN.md "Same flags everywhere").

``--model`` takes a preset name, a JSON file of
:class:`~topomesh.models.transformer.TransformerConfig` fields, or ``path.py:function`` —
the user's own model: a function returning ``(ModelSpec, parallelize)``; when it takes a
parameter named ``training`` it receives the :class:`~topomesh.sim.simulate.Training`
knobs (recompute, sequence parallel) to build its parallelization from.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

from topomesh.cli.argtypes import MAX_BATCH, MAX_RANKS, MAX_SEQ_LEN, bounded_int
from topomesh.errors import LayoutError, ModelConfigError, TopomeshError
from topomesh.sim.schedules import Schedule
from topomesh.sim.simulate import DTYPES, RECOMPUTE, Model, Training, builtin_model

AXES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
_CONFIG_MAX_BYTES = 1 << 20


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """Model, cluster, layout and training flags: what every planning command takes."""
    add_model_arguments(p)
    add_cluster_arguments(p)
    add_layout_arguments(p)
    add_training_arguments(p)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="PRESET|FILE.json|PATH.py:FN",
                   help="a preset (topomesh.models.presets), a JSON file of TransformerConfig fields, or "
                        "path.py:function returning (ModelSpec, parallelize)")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    from topomesh.cost.cluster import cluster_names

    p.add_argument("--cluster", default=None, help=f"a cluster preset: {', '.join(cluster_names())} "
                                                   "(default dgx-h100 unless --topology is given)")
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="a topology file (anything `topomesh show` reads) instead of --cluster")
    p.add_argument("--device", default=None, help="device of --topology's ranks (default: detected)")
    p.add_argument("--gpus", type=bounded_int(1, MAX_RANKS), default=None, metavar="N",
                   help="world size: the preset's (or the file's) node repeated to N ranks")


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    for axis in AXES:
        flags = [f"--{axis.replace('_', '-')}"] + (["--dp"] if axis == "dp_replicate" else [])
        p.add_argument(*flags, dest=axis, type=bounded_int(1, MAX_RANKS, rest=True), default=None, metavar="N",
                       help=f"degree of {axis} (-1: the rest)")
    p.add_argument("--layout", default=None, metavar="AXIS=N,...", help="the degrees as one spec, e.g. tp=8,pp=2,dp_shard=-1")
    p.add_argument("--order", default=None, metavar="A-B-...",
                   help="axis order, fastest first (default tp-cp-ep-dp_shard-dp_replicate-pp)")


def add_training_arguments(p: argparse.ArgumentParser, *,
                           global_batch_default: str = "data-parallel degree × micro-batch, × 4·pp with a pipeline"
                           ) -> None:
    p.add_argument("--global-batch", type=bounded_int(1, MAX_BATCH), default=None, metavar="N",
                   help=f"samples per step (default: {global_batch_default})")
    p.add_argument("--micro-batch", type=bounded_int(1, MAX_BATCH), default=1, metavar="N", help="samples per micro-batch (default 1)")
    p.add_argument("--seq-len", type=bounded_int(1, MAX_SEQ_LEN), default=None, metavar="N", help="tokens per sample (default: the model's)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="training dtype (default bf16)")
    p.add_argument("--recompute", "--checkpointing", dest="recompute", default="none", choices=RECOMPUTE,
                   help="activation recomputation (default none)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="sequence parallel with tensor parallel (default on)")
    p.add_argument("--schedule", default=Schedule.ONE_F_ONE_B.value, choices=[s.value for s in Schedule],
                   help="pipeline schedule (default 1f1b)")
    p.add_argument("--interleave", type=bounded_int(1, 1024), default=1, metavar="V", help="virtual stages per pipeline rank")
    p.add_argument("--mixed-precision", action=argparse.BooleanOptionalAction, default=True,
                   help="with FSDP (a dp or cp axis): float32 master weights and optimizer state, "
                        "compute in --dtype, gradients reduced in float32 (default on)")


def load_model(text: str, *, seq_len: int | None = None) -> Model:
    """A :class:`Model` from ``--model`` (see the module docstring)."""
    from topomesh.models.presets import PRESETS, get_preset

    if text in PRESETS:
        return builtin_model(get_preset(text), seq_len=seq_len)
    if text.endswith(".json"):
        return builtin_model(_config_from_json(Path(text)), seq_len=seq_len)
    path, sep, fn = text.rpartition(":")
    if sep and path.endswith(".py"):
        return _user_model(Path(path), fn, seq_len)
    raise ModelConfigError(
        f"--model {text!r} is not a preset ({', '.join(PRESETS)}), a .json config file or path.py:function.")


def _config_from_json(path: Path) -> object:
    from topomesh.models.transformer import Arch, TransformerConfig
    from topomesh.topology.api import read_json

    raw = read_json(path, what="model config", error=ModelConfigError)
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: a model config must be a JSON object of TransformerConfig fields.")
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ModelConfigError(f"{path}: unknown model config field(s) {', '.join(unknown)}; known: {', '.join(fields)}.")
    kw = dict(raw)
    kw.setdefault("name", path.stem)
    for name, value in kw.items():
        if name == "arch":
            try:
                kw[name] = Arch(value)
            except ValueError:
                raise ModelConfigError(f"{path}: arch {value!r} is not one of {', '.join(a.value for a in Arch)}.") from None
        elif name == "name":
            if not isinstance(value, str) or not value or len(value) > 200:
                raise ModelConfigError(f"{path}: name must be a short non-empty string.")
        elif name in ("capacity_factor", "norm_eps", "rope_theta"):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e12:
                raise ModelConfigError(f"{path}: {name} must be a positive number, got {value!r}.")
        elif name == "n_kv_heads" and value is None:
            continue
        elif isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 24:
            raise ModelConfigError(f"{path}: {name} must be an integer between 0 and {1 << 24}, got {value!r}.")
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in kw]
    if missing:
        raise ModelConfigError(f"{path}: model config lacks {', '.join(missing)}.")
    try:
        return TransformerConfig(**kw)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TopomeshError):
            raise
        raise ModelConfigError(f"{path}: {exc}") from None


def _user_model(path: Path, fn: str, seq_len: int | None) -> Model:
    from topomesh.trace.tracer import ModelSpec

    if not path.is_file():
        raise ModelConfigError(f"--model: no such Python file {path}.")
    name = f"_topomesh_user_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelConfigError(f"--model: cannot import {path}.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # the user's own code, named on the command line
    except Exception as exc:  # report the user's error in one line
        raise ModelConfigError(f"--model: importing {path} failed: {type(exc).__name__}: {exc}") from None
    func = getattr(module, fn, None)
    if not callable(func):
        raise ModelConfigError(f"--model: {path} has no function {fn!r}.")
    takes_training = "training" in inspect.signature(func).parameters

    def call(training: Training | None) -> tuple:
        try:
            got = func(training=training) if takes_training else func()
        except TopomeshError:
            raise
        except Exception as exc:
            raise ModelConfigError(f"--model: {path}:{fn}() failed: {type(exc).__name__}: {exc}") from None
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], ModelSpec)):
            raise ModelConfigError(f"--model: {path}:{fn}() must return (ModelSpec, parallelize), got {type(got).__name__}.")
        return got

    model_spec, _ = call(None)
    return Model(spec=model_spec, parallelize=lambda t, _mixed: call(t)[1], seq_len=seq_len or getattr(model_spec, "seq_len", None))


def cluster_from_args(args: argparse.Namespace) -> object:
    from topomesh.cost.cluster import cluster_from_topology, load_cluster

    if args.gpus is not None and args.gpus < 1:
        raise LayoutError(f"--gpus must be a positive integer, got {args.gpus}.")
    if args.topology:
        if args.cluster:
            raise LayoutError("give --cluster or --topology, not both.")
        return cluster_from_topology(args.topology, device=args.device, gpus=args.gpus)
    if args.device:
        raise LayoutError("--device goes with --topology; a --cluster preset names its device.")
    return load_cluster(args.cluster or "dgx-h100", gpus=args.gpus)


def layout_from_args(args: argparse.Namespace, world_size: int) -> object:
    from topomesh.layout.api import resolve_layout
    from topomesh.layout.dims import merge_degrees, parse_degrees

    flags = {a: getattr(args, a) for a in AXES if getattr(args, a) is not None}
    degrees = merge_degrees(flags, parse_degrees(args.layout, allow_rest=True)) if args.layout else flags
    if not degrees:
        degrees = {"dp_shard": -1}
    return resolve_layout(degrees, world_size, order=args.order)


def training_from_args(args: argparse.Namespace, layout: object, model: Model) -> Training:
    from topomesh.layout.dims import Axis

    dp = layout.degree(Axis.DP_REPLICATE) * layout.degree(Axis.DP_SHARD)
    pp = layout.degree(Axis.PP)
    if args.micro_batch is None or args.micro_batch < 1:
        raise LayoutError(f"--micro-batch must be a positive integer, got {args.micro_batch}.")
    gb = args.global_batch if args.global_batch is not None else dp * args.micro_batch * (4 * pp if pp > 1 else 1)
    return Training(global_batch=gb, micro_batch=args.micro_batch, seq_len=args.seq_len or model.seq_len,
                    dtype=args.dtype, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                    schedule=Schedule(args.schedule), interleave=args.interleave,
                    mixed_precision=args.mixed_precision)
