"""What parallelize_transformer does to the modules (fake process group, fake tensors)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from topomesh.errors import LayoutError
from topomesh.models.parallelize import Checkpointing, ParallelOptions, parallelize_transformer
from topomesh.models.presets import get_preset
from topomesh.models.transformer import Transformer
from topomesh.trace.tracer import fake_process_group


def _model(name: str) -> Transformer:
    with FakeTensorMode(allow_non_fake_inputs=True):
        return Transformer(get_preset(name))


def test_tp_fsdp_placements() -> None:
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        model = parallelize_transformer(_model("tiny-llama"), mesh)
        block = model.layers["0"]
        assert isinstance(model, FSDPModule) and isinstance(block, FSDPModule)
        wq, wo = block.attention.wq.weight, block.attention.wo.weight
        assert isinstance(wq, DTensor) and wq.device_mesh.mesh_dim_names == ("dp_shard", "tp")
        # FSDP shards dim 0 over dp_shard (strided when TP already split dim 0); TP shards
        # wq's rows (colwise) and wo's columns (rowwise)
        assert [p.dim for p in wq.placements] == [0, 0]
        assert wq.placements[1] == Shard(0)
        assert wo.placements == (Shard(0), Shard(1))
        assert wq.to_local().shape == (64 // 4, 64)
        assert wo.to_local().shape == (64 // 2, 64 // 2)


def test_expert_parallel_shards_experts() -> None:
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        model = parallelize_transformer(_model("tiny-moe"), mesh)
        w1 = model.layers["0"].feed_forward.experts.w1
        assert isinstance(w1, DTensor) and w1.placements == (Shard(0),)
        assert w1.to_local().shape[0] == get_preset("tiny-moe").n_experts // 2


def test_checkpointing_wraps_blocks() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
        for mode in (Checkpointing.FULL, Checkpointing.SELECTIVE):
            model = parallelize_transformer(_model("tiny-gpt"), mesh, ParallelOptions(checkpointing=mode))
            assert all(isinstance(b, CheckpointWrapper) for b in model.layers.values())


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt"])
def test_context_parallel_wraps_attention_and_cuts_position_tables(preset: str) -> None:
    import torch

    cfg = get_preset(preset)
    model = Transformer(cfg)  # real tensors: the cut tables are checked by value
    tables = {n: getattr(model, n).clone() for n in ("rope_cos", "rope_sin", "positions") if getattr(model, n) is not None}
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        parallelize_transformer(model, mesh)
        assert all(b.attention.sdpa._forward_pre_hooks for b in model.layers.values())
        assert isinstance(model, FSDPModule) and model.layers["0"].attention.wq.weight.device_mesh.mesh_dim_names == ("cp",)
    # rank 0 of cp=2 keeps chunks 0 and 3 of 4 (head-tail), rows of every per-position table
    quarter = cfg.seq_len // 4
    keep = torch.cat((torch.arange(0, quarter), torch.arange(3 * quarter, 4 * quarter)))
    assert tables and all(torch.equal(getattr(model, n), t[keep]) for n, t in tables.items())


def test_cp_shard_needs_even_chunks_of_one_length() -> None:
    import torch

    from topomesh.models.parallelize import cp_shard

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        with pytest.raises(LayoutError, match=r"divisible by 2·2 = 4 .* it is 30"):
            cp_shard(mesh, [torch.zeros(1, 30)], [1])
        with pytest.raises(LayoutError, match=r"different sequence lengths \[8, 16\]"):
            cp_shard(mesh, [torch.zeros(1, 16), torch.zeros(8)], [1, 0])
        (tokens,) = cp_shard(mesh, [torch.arange(16).view(1, 16)], [1])
        assert tokens.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]


def test_fsdp_mesh_takes_cp_with_dp_shard_under_replicate() -> None:
    from topomesh.models.parallelize import fsdp_mesh

    with fake_process_group(16):
        mesh = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        hsdp = fsdp_mesh(mesh)
        assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and tuple(hsdp.mesh.shape) == (2, 4)
        assert fsdp_mesh(mesh["tp"]) is None
        assert fsdp_mesh(mesh["cp"]).mesh_dim_names == ("cp",)


def test_expert_degree_must_divide_experts() -> None:
    cfg = dataclasses.replace(get_preset("tiny-moe"), n_experts=3, top_k=1)
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = Transformer(cfg)
        with pytest.raises(LayoutError, match="does not divide 3 experts"):
            parallelize_transformer(model, mesh)
    assert not dist.is_initialized()


def test_tp_degree_must_divide_heads() -> None:
    with fake_process_group(3):
        mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("tp",))
        with pytest.raises(LayoutError, match="degree 3 does not divide n_heads=8 of tiny-llama"):
            parallelize_transformer(_model("tiny-llama"), mesh)
