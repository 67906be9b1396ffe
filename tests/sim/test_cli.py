"""`topomesh simulate` from the command line: output, JSON keys, the user's own model, bad input."""

from __future__ import annotations

import json
import textwrap

import pytest

from topomesh.cli.main import main

USER_MODEL = '''
import torch
from torch import nn
from topomesh.trace.tracer import ModelSpec


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):  # not a preset: an MLP stack over token embeddings
    def __init__(self, depth, width=64, vocab=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.layers:
            x = b(x)
        return self.out(x)


def build():
    spec = ModelSpec(
        name="user-mlp", key="user-mlp-64", n_layers=6, build=lambda n: Net(n),
        make_inputs=lambda b: ((torch.randint(0, 128, (b, 16)),), torch.randint(0, 128, (b, 16))),
    )

    def parallelize(model, mesh):
        from torch.distributed.fsdp import fully_shard
        for blk in model.layers:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    return spec, parallelize
'''


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOPOMESH_CACHE_DIR", str(tmp_path / "cache"))


def test_table_and_json(capsys):
    code, out, _ = run_cli(capsys, "simulate", "--model", "tiny-llama", "--cluster", "dgx-a100-80gb",
                           "--gpus", "8", "--tp", "2", "--dp-shard", "-1")
    assert code == 0
    assert "step time" in out and "Where the step goes" in out and "NVSwitch" in out
    code, out, _ = run_cli(capsys, "simulate", "--model", "tiny-llama", "--cluster", "dgx-a100-80gb",
                           "--gpus", "8", "--layout", "tp=2,dp_shard=-1", "--json")
    doc = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "mfu", "hfu", "peak_memory_bytes", "feasible", "reason", "breakdown"):
        assert key in doc
    assert set(doc["breakdown"]) == {"compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "p2p_s"}
    assert doc["layout"]["degrees"]["dp_shard"] == 4 and doc["world_size"] == 8
    # global batch defaults to dp × micro-batch: 4 samples of 32 tokens
    assert doc["tokens_per_s"] == pytest.approx(4 * 32 / doc["step_time_s"])


def test_user_model_from_a_python_file(tmp_path, capsys):
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent(USER_MODEL))
    timeline = tmp_path / "step.json"
    code, out, err = run_cli(capsys, "simulate", "--model", f"{path}:build", "--cluster", "dgx-h100", "--gpus", "8",
                             "--dp-shard", "8", "--seq-len", "16", "--json", "--timeline", str(timeline))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["feasible"] and doc["step_time_s"] > 0
    # FSDP over 8 ranks: the blocks' gathers are overlapped, the rest exposed on dp_shard only
    assert set(doc["breakdown"]["exposed_comm_s"]) <= {"dp_shard"}
    events = json.loads(timeline.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("block fwd") for e in events)


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "tiny-llama", "--gpus", "8", "--tp", "3"], "tp=3"),
    (["--model", "tiny-llama", "--gpus", "8", "--tp", "2", "--dp-shard", "2"], "needs 4 ranks"),
    (["--model", "tiny-llama", "--cluster", "dgx-z9000"], "dgx-z9000"),
    (["--model", "tiny-llama", "--gpus", "16", "--ep", "2", "--dp-shard", "8"], "ep=2 needs a mixture-of-experts"),
    (["--model", "tiny-llama", "--gpus", "16", "--pp", "4", "--dp-shard", "4"], "4 pipeline stages"),
    (["--model", "no-such-model"], "not a preset"),
    (["--model", "BAD.json"], "bad.json: n_layers must be an integer"),
    (["--model", "tiny-llama", "--gpus", "8", "--global-batch", "3"], "global batch 3 does not divide"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, message):
    argv = [a.replace("BAD.json", str(tmp_path / "bad.json")) for a in argv]
    (tmp_path / "bad.json").write_text('{"name": "x", "n_layers": "many"}')
    code, out, err = run_cli(capsys, "simulate", *argv)
    assert code == 2
    assert err.startswith("topomesh: error:") and err.count("\n") == 1, err
    assert message in err


def test_a_measured_op_table_takes_precedence(tmp_path, capsys):
    """Every op of the trace stored for the H100's reported name at 1 ms: the simulator must
    price each of them at exactly that (and none by the roofline)."""
    from topomesh.cost.cluster import load_cluster
    from topomesh.cost.opdb import OpProfileDB, OpTiming
    from topomesh.cost.ops import profilable, profile_key
    from topomesh.layout.dims import Layout
    from topomesh.models.presets import get_preset
    from topomesh.sim.simulate import Simulator, Training, builtin_model
    from topomesh.trace.graph import OpRecord

    sim = Simulator(model=builtin_model(get_preset("tiny-llama")), cluster=load_cluster("dgx-h100", gpus=8))
    trace = sim.trace(Layout(dp_shard=8), Training(global_batch=8))
    keys = {profile_key(e) for s in trace.segments for e in s.events if isinstance(e, OpRecord) and profilable(e)}
    db = tmp_path / "ops.sqlite"
    with OpProfileDB(db) as store:
        store.put("NVIDIA H100 80GB HBM3", [OpTiming(key=k, median_s=1e-3, repeats=5, warmup=2, method="test")
                                            for k in keys])
    code, out, err = run_cli(capsys, "simulate", "--model", "tiny-llama", "--gpus", "8", "--dp-shard", "8",
                             "--db", str(db), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["roofline_ops"] == 0 and doc["measured_ops"] > 0
    # compute is a whole number of milliseconds: every forward and backward op took 1 ms
    assert doc["breakdown"]["compute_s"] * 1e3 == pytest.approx(round(doc["breakdown"]["compute_s"] * 1e3), abs=1e-6)
