"""What a record may run: the op allow-list, tensor bounds, and the output check before a real run."""

from __future__ import annotations

import pytest

from topomesh.cost.opcheck import MAX_RECORD_BYTES, op_family, record_problem, storage_numel
from topomesh.cost.ops import time_op
from topomesh.trace.graph import OpRecord, TensorMeta

A = TensorMeta(shape=(8, 8), dtype="float32", stride=(8, 1))


@pytest.mark.parametrize(
    "op, family",
    [
        ("aten.mm.default", "matmul"),
        ("aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "attention"),
        ("aten.add_.Tensor", "elementwise"),
        ("aten.sum.dim_IntList", "reduction"),
        ("aten._log_softmax_backward_data.default", "softmax"),
        ("aten.native_layer_norm_backward.default", "norm"),
        ("aten.embedding_dense_backward.default", "embedding"),
        ("fsdp.split_with_sizes_copy.default", "view_copy"),
        ("aten.nll_loss_forward.default", "loss"),
        ("aten._foreach_lerp_.Scalar", "optimizer"),
        ("aten.from_file.default", None),
        ("aten._foobar.default", None),
        ("aten.mm.out", None),
        ("aten.sum.IntList_out", None),
        ("aten", None),
        ("aten.mm.default.extra", None),
        ("prims.mm.default", None),
    ],
)
def test_op_families(op, family):
    assert op_family(op) == family


def test_storage_numel_by_hand():
    # 1 + (3-1)·1 + (4-1)·3 = 12: a transposed 3×4
    assert storage_numel(TensorMeta(shape=(3, 4), dtype="float32", stride=(1, 3))) == 12
    assert storage_numel(TensorMeta(shape=(2, 0, 5), dtype="float32", stride=(5, 5, 1))) == 0
    assert storage_numel(TensorMeta(shape=(), dtype="float32", stride=())) == 1


def test_record_problem_is_none_for_a_traced_mm_and_names_the_bad_part():
    assert record_problem(OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(A,), flops=1024)) is None
    bad = TensorMeta(shape=(8, 8), dtype="float32", stride=(8, -1))
    assert record_problem(OpRecord(op="aten.mm.default", inputs=(A, bad), outputs=())) == (
        "input 1: stride -1 is not a whole number from 0 to 4294967296")
    assert record_problem(OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(), flops=10**18 + 1)) == (
        "flops 1000000000000000001 is not a whole number from 0 to 1000000000000000000")
    assert record_problem(OpRecord(op="aten.mm.default", inputs=(A, A), outputs=(), flops=True)) == (
        "flops True is not a whole number from 0 to 1000000000000000000")


def test_time_op_refuses_what_the_allow_list_does_not_hold(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rec = OpRecord(op="aten.from_file.default", inputs=(), outputs=(), args=("PWNED", True, 16))
    with pytest.raises(ValueError, match=r"^aten.from_file.default is not run: op 'aten.from_file.default' is not one"):
        time_op(rec, "cpu", min_repeats=1, budget_s=0.0)
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(ValueError, match=r"is not run: input 0: size -8 is not a whole number"):
        time_op(OpRecord(op="aten.relu.default", inputs=(TensorMeta(shape=(-8,), dtype="float32", stride=(1,)),),
                         outputs=()), "cpu")


def test_sizes_taken_from_arguments_are_checked_before_anything_is_allocated():
    # new_zeros(A, [2**20, 2**20]) in float32: 2**40 · 4 bytes = 4 TiB of output from a 256-byte input
    rec = OpRecord(op="aten.new_zeros.default", inputs=(A,), outputs=(), args=([2**20, 2**20],))
    with pytest.raises(ValueError, match=rf"aten.new_zeros.default would take {2**42 + 256} bytes of inputs and "
                                         rf"outputs, more than the {MAX_RECORD_BYTES} allowed"):
        time_op(rec, "cpu", min_repeats=1, budget_s=0.0)
    # the same op with a small size runs: 4·4 zeros
    small = OpRecord(op="aten.new_zeros.default", inputs=(A,), outputs=(), args=([4, 4],))
    assert time_op(small, "cpu", min_repeats=1, budget_s=0.0).median_s > 0


def test_a_view_is_not_counted_twice():
    # a view of a 40 GiB input (float32, 10·2**30 elements) aliases it: 40 GiB < 64 GiB, passes the output check;
    # counted twice it would be 80 GiB. Only the fake run is made (ValueError would come before any allocation).
    from topomesh.cost.opcheck import check_outputs
    from topomesh.cost.ops import _call_arguments, resolve_op

    big = TensorMeta(shape=(10 * 2**30,), dtype="float32", stride=(1,))
    rec = OpRecord(op="aten.view.default", inputs=(big,), outputs=(), args=([10, 2**30],))
    op = resolve_op(rec.op)
    check_outputs(op, rec, lambda t: _call_arguments(op, t, rec.args))
    clone = OpRecord(op="aten.clone.default", inputs=(big,), outputs=())
    op = resolve_op(clone.op)
    with pytest.raises(ValueError, match=rf"would take {2 * 40 * 2**30} bytes"):
        check_outputs(op, clone, lambda t: _call_arguments(op, t, clone.args))
