"""Bad input to csa::compressor / csa::compressor_backward: a ValueError/RuntimeError that
names the argument and the expected value, with pinned wording; and degenerate but valid inputs."""

from __future__ import annotations

import expecttest
import pytest
import torch
from helpers import (
    PackSpec,
    assert_bitwise_equal,
    eager_forward_backward,
    make_pack,
    offsets,
    op_forward_backward,
)

PACK = PackSpec((6, 0, 5), ratio=2, coff=2, head_dim=3, extra_tokens=2, extra_rows=1)
T, WIDTH = PACK.num_tokens, PACK.coff * PACK.head_dim


def _call(**changes):
    """Forward op on the base pack with some arguments replaced."""
    pack = make_pack(PACK)
    args = {"kv": pack.kv, "score": pack.score, "ape": pack.ape, "cu_seqlens": pack.cu_seqlens,
            "cu_seqlens_comp": pack.cu_seqlens_comp, "ratio": PACK.ratio, "coff": PACK.coff,
            "total_comp": PACK.capacity}
    args.update(changes)
    return lambda: torch.ops.csa.compressor(*args.values())


def _call_backward(**changes):
    pack = make_pack(PACK)
    args = {"grad_out": pack.grad_out(), "kv": pack.kv, "score": pack.score, "ape": pack.ape,
            "cu_seqlens": pack.cu_seqlens, "cu_seqlens_comp": pack.cu_seqlens_comp,
            "ratio": PACK.ratio, "coff": PACK.coff}
    args.update(changes)
    return lambda: torch.ops.csa.compressor_backward(*args.values())


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _huge(rows, width=WIDTH):
    """A (rows, width) fp32 tensor that allocates one row: zero stride along the tokens."""
    return torch.zeros(1, width).expand(rows, width)


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


CU, CUC = offsets(PACK.lengths, PACK.ratio)

# id -> (call, the argument name the message must carry in backticks)
FORWARD_CASES = {
    "kv_rank_1": (_call(kv=torch.zeros(T * WIDTH)), "kv"),
    "kv_rank_3": (_call(kv=torch.zeros(T, PACK.coff, PACK.head_dim)), "kv"),
    "kv_dtype_int": (_call(kv=torch.zeros(T, WIDTH, dtype=torch.int32)), "kv"),
    "kv_width_not_multiple_of_coff": (_call(kv=torch.zeros(T, 7), score=torch.zeros(T, 7)),
                                      "kv"),
    "kv_width_zero": (_call(kv=torch.zeros(T, 0), score=torch.zeros(T, 0),
                            ape=torch.zeros(2, 0)), "kv"),
    "score_shape": (_call(score=torch.zeros(T, WIDTH + 2)), "score"),
    "score_rank_1": (_call(score=torch.zeros(T * WIDTH)), "score"),
    "score_dtype": (_call(score=torch.zeros(T, WIDTH, dtype=torch.bfloat16)), "score"),
    "score_device": (_call(score=_meta(T, WIDTH)), "score"),
    "ape_rows": (_call(ape=torch.zeros(PACK.ratio + 1, WIDTH)), "ape"),
    "ape_width": (_call(ape=torch.zeros(PACK.ratio, PACK.head_dim)), "ape"),
    "ape_rank_1": (_call(ape=torch.zeros(PACK.ratio * WIDTH)), "ape"),
    "ape_dtype_int": (_call(ape=torch.zeros(PACK.ratio, WIDTH, dtype=torch.int32)), "ape"),
    "ape_fp64_with_fp32_kv": (_call(ape=torch.zeros(PACK.ratio, WIDTH, dtype=torch.float64)),
                              "ape"),
    "ape_dtype_int_fp64_kv": (_call(kv=torch.zeros(T, WIDTH, dtype=torch.float64),
                                    score=torch.zeros(T, WIDTH, dtype=torch.float64),
                                    ape=torch.zeros(PACK.ratio, WIDTH, dtype=torch.int64)), "ape"),
    "ape_device": (_call(ape=_meta(PACK.ratio, WIDTH)), "ape"),
    "cu_dtype_int64": (_call(cu_seqlens=CU.long()), "cu_seqlens"),
    "cuc_dtype_int64": (_call(cu_seqlens_comp=CUC.long()), "cu_seqlens_comp"),
    "cu_rank_2": (_call(cu_seqlens=CU[None]), "cu_seqlens"),
    "cu_empty": (_call(cu_seqlens=_cu([]), cu_seqlens_comp=_cu([])), "cu_seqlens"),
    "cu_lengths_differ": (_call(cu_seqlens_comp=CUC[:-1]), "cu_seqlens_comp"),
    "cu_device": (_call(cu_seqlens=CU.to("meta")), "cu_seqlens"),
    "cuc_device": (_call(cu_seqlens_comp=CUC.to("meta")), "cu_seqlens_comp"),
    "ratio_zero": (_call(ratio=0), "ratio"),
    "ratio_negative": (_call(ratio=-2), "ratio"),
    "coff_zero": (_call(coff=0), "coff"),
    "coff_three": (_call(coff=3), "coff"),
    "total_comp_negative": (_call(total_comp=-1), "total_comp"),
    "total_comp_below_true_count": (_call(total_comp=PACK.true_rows - 1), "total_comp"),
    "total_comp_overflows_int32": (_call(total_comp=2**31 // PACK.head_dim + 1), "total_comp"),
    "kv_overflows_int32_expanded": (_call(kv=_huge(2**31 // WIDTH + 1),
                                          score=_huge(2**31 // WIDTH + 1)), "kv"),
    "kv_overflows_int32_meta": (_call(kv=_meta(2**31 // WIDTH + 1, WIDTH),
                                      score=_meta(2**31 // WIDTH + 1, WIDTH),
                                      ape=_meta(PACK.ratio, WIDTH),
                                      cu_seqlens=CU.to("meta"), cu_seqlens_comp=CUC.to("meta")),
                                "kv"),
    "cu_first_not_zero": (_call(cu_seqlens=_cu([1, 6, 6, 11])), "cu_seqlens[0]"),
    "cuc_first_not_zero": (_call(cu_seqlens_comp=_cu([1, 4, 4, 6])), "cu_seqlens_comp[0]"),
    "cu_decreasing": (_call(cu_seqlens=_cu([0, 6, 4, 11])), "cu_seqlens"),
    "cu_beyond_tokens": (_call(cu_seqlens=_cu([0, 6, 6, T + 1]),
                               cu_seqlens_comp=_cu([0, 3, 3, 3 + (T + 1 - 6) // 2])),
                         "cu_seqlens[-1]"),
    "cuc_not_len_over_ratio": (_call(cu_seqlens_comp=_cu([0, 3, 3, 6])), "cu_seqlens_comp"),
    "cuc_decreasing": (_call(cu_seqlens_comp=_cu([0, 3, 2, 5])), "cu_seqlens_comp"),
}

BACKWARD_CASES = {
    "grad_out_width": (_call_backward(grad_out=torch.zeros(PACK.capacity, PACK.head_dim + 1)),
                       "grad_out"),
    "grad_out_rank_1": (_call_backward(grad_out=torch.zeros(PACK.capacity)), "grad_out"),
    "grad_out_dtype": (_call_backward(grad_out=torch.zeros(PACK.capacity, PACK.head_dim,
                                                           dtype=torch.float64)), "grad_out"),
    "grad_out_device": (_call_backward(grad_out=_meta(PACK.capacity, PACK.head_dim)),
                        "grad_out"),
    # The backward op has no total_comp: its row count is grad_out's, so name grad_out.
    "grad_out_fewer_rows_than_true_count": (
        _call_backward(grad_out=torch.zeros(PACK.true_rows - 1, PACK.head_dim)), "grad_out"),
    "backward_kv_dtype": (_call_backward(kv=torch.zeros(T, WIDTH, dtype=torch.int64)), "kv"),
    "backward_ape_dtype": (_call_backward(ape=torch.zeros(PACK.ratio, WIDTH, dtype=torch.bool)),
                           "ape"),
    "backward_ratio_zero": (_call_backward(ratio=0), "ratio"),
    "backward_cuc_not_len_over_ratio": (_call_backward(cu_seqlens_comp=_cu([0, 3, 3, 6])),
                                        "cu_seqlens_comp"),
}

CASES = {**FORWARD_CASES, **BACKWARD_CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_naming_the_argument(case):
    call, argument = CASES[case]
    with pytest.raises((ValueError, RuntimeError)) as info:
        call()
    assert f"`{argument}`" in str(info.value), str(info.value)


def _messages(cases, ids):
    lines = []
    for case in ids:
        try:
            cases[case][0]()
        except (ValueError, RuntimeError, TypeError) as error:
            lines.append(f"{case}: {type(error).__name__}: {error}")
        else:
            lines.append(f"{case}: no error")
    return "\n".join(lines)


class TestErrorMessages(expecttest.TestCase):
    def test_metadata_messages(self):
        ids = [c for c in FORWARD_CASES if not c.startswith(("cu_first", "cuc_first", "cu_dec",
                                                             "cu_beyond", "cuc_not", "cuc_dec"))]
        self.assertExpectedInline(_messages(FORWARD_CASES, ids), """\
kv_rank_1: ValueError: csa.compressor: `kv` must be 2-D (T, coff*head_dim), got shape (78,)
kv_rank_3: ValueError: csa.compressor: `kv` must be 2-D (T, coff*head_dim), got shape (13, 2, 3)
kv_dtype_int: ValueError: csa.compressor: `kv` must be one of bfloat16, float16, float32, float64, got torch.int32
kv_width_not_multiple_of_coff: ValueError: csa.compressor: `kv` width must be a positive multiple of coff=2, got 7
kv_width_zero: ValueError: csa.compressor: `kv` width must be a positive multiple of coff=2, got 0
score_shape: ValueError: csa.compressor: `score` must have the shape of `kv` (13, 6), got (13, 8)
score_rank_1: ValueError: csa.compressor: `score` must have the shape of `kv` (13, 6), got (78,)
score_dtype: ValueError: csa.compressor: `score` must have the dtype of `kv` (torch.float32), got torch.bfloat16
score_device: ValueError: csa.compressor: `score` must be on the device of `kv` (cpu), got meta
ape_rows: ValueError: csa.compressor: `ape` must have shape (ratio, coff*head_dim) = (2, 6), got (3, 6)
ape_width: ValueError: csa.compressor: `ape` must have shape (ratio, coff*head_dim) = (2, 6), got (2, 3)
ape_rank_1: ValueError: csa.compressor: `ape` must have shape (ratio, coff*head_dim) = (2, 6), got (12,)
ape_dtype_int: ValueError: csa.compressor: `ape` must be one of bfloat16, float16, float32 (float64 only with float64 `kv`), got torch.int32
ape_fp64_with_fp32_kv: ValueError: csa.compressor: `ape` must be one of bfloat16, float16, float32 (float64 only with float64 `kv`), got torch.float64
ape_dtype_int_fp64_kv: ValueError: csa.compressor: `ape` must be one of bfloat16, float16, float32, float64, got torch.int64
ape_device: ValueError: csa.compressor: `ape` must be on the device of `kv` (cpu), got meta
cu_dtype_int64: ValueError: csa.compressor: `cu_seqlens` must be int32, got torch.int64
cuc_dtype_int64: ValueError: csa.compressor: `cu_seqlens_comp` must be int32, got torch.int64
cu_rank_2: ValueError: csa.compressor: `cu_seqlens` must be 1-D (B+1,), got shape (1, 4)
cu_empty: ValueError: csa.compressor: `cu_seqlens` must hold at least one offset (B+1 >= 1), got 0
cu_lengths_differ: ValueError: csa.compressor: `cu_seqlens` and `cu_seqlens_comp` must have the same length B+1, got 4 and 3
cu_device: ValueError: csa.compressor: `cu_seqlens` must be on the device of `kv` (cpu), got meta
cuc_device: ValueError: csa.compressor: `cu_seqlens_comp` must be on the device of `kv` (cpu), got meta
ratio_zero: ValueError: csa.compressor: `ratio` must be an int >= 1, got 0
ratio_negative: ValueError: csa.compressor: `ratio` must be an int >= 1, got -2
coff_zero: ValueError: csa.compressor: `coff` must be 1 or 2, got 0
coff_three: ValueError: csa.compressor: `coff` must be 1 or 2, got 3
total_comp_negative: ValueError: csa.compressor: `total_comp` must be >= 0 or None, got -1
total_comp_below_true_count: ValueError: csa.compressor: `total_comp` = 4 is smaller than the true row count cu_seqlens_comp[-1] = 5
total_comp_overflows_int32: ValueError: csa.compressor: `total_comp` * head_dim = 2147483649 overflows int32 offsets
kv_overflows_int32_expanded: ValueError: csa.compressor: `kv` has 2147483652 elements, which overflows int32 offsets (at most 2147483647)
kv_overflows_int32_meta: ValueError: csa.compressor: `kv` has 2147483652 elements, which overflows int32 offsets (at most 2147483647)""")

    def test_offset_content_messages(self):
        ids = ["cu_first_not_zero", "cuc_first_not_zero", "cu_decreasing", "cu_beyond_tokens",
               "cuc_not_len_over_ratio", "cuc_decreasing"]
        self.assertExpectedInline(_messages(FORWARD_CASES, ids), """\
cu_first_not_zero: ValueError: csa.compressor: `cu_seqlens[0]` must be 0, got 1
cuc_first_not_zero: ValueError: csa.compressor: `cu_seqlens_comp[0]` must be 0, got 1
cu_decreasing: ValueError: csa.compressor: `cu_seqlens` must be non-decreasing, got 6 then 4 at 1
cu_beyond_tokens: ValueError: csa.compressor: `cu_seqlens[-1]` = 14 exceeds the number of tokens T = 13
cuc_not_len_over_ratio: ValueError: csa.compressor: `cu_seqlens_comp` must count len // ratio rows per segment: segment 2 has 5 tokens, so 2 rows at ratio 2, got 3
cuc_decreasing: ValueError: csa.compressor: `cu_seqlens_comp` must count len // ratio rows per segment: segment 1 has 0 tokens, so 0 rows at ratio 2, got -1""")

    def test_backward_messages(self):
        self.assertExpectedInline(_messages(BACKWARD_CASES, list(BACKWARD_CASES)), """\
grad_out_width: ValueError: csa.compressor_backward: `grad_out` must be 2-D (rows, head_dim=3), got (6, 4)
grad_out_rank_1: ValueError: csa.compressor_backward: `grad_out` must be 2-D (rows, head_dim=3), got (6,)
grad_out_dtype: ValueError: csa.compressor_backward: `grad_out` must have the dtype of `kv` (torch.float32), got torch.float64
grad_out_device: ValueError: csa.compressor_backward: `grad_out` must be on the device of `kv` (cpu), got meta
grad_out_fewer_rows_than_true_count: ValueError: csa.compressor_backward: `grad_out` row count = 4 is smaller than the true row count cu_seqlens_comp[-1] = 5
backward_kv_dtype: ValueError: csa.compressor_backward: `kv` must be one of bfloat16, float16, float32, float64, got torch.int64
backward_ape_dtype: ValueError: csa.compressor_backward: `ape` must be one of bfloat16, float16, float32 (float64 only with float64 `kv`), got torch.bool
backward_ratio_zero: ValueError: csa.compressor_backward: `ratio` must be an int >= 1, got 0
backward_cuc_not_len_over_ratio: ValueError: csa.compressor_backward: `cu_seqlens_comp` must count len // ratio rows per segment: segment 2 has 5 tokens, so 2 rows at ratio 2, got 3""")


# Degenerate but valid inputs: shapes, exact zeros, and the same answers as the eager model.
DEGENERATE = {
    "no_segments_B0": PackSpec((), ratio=4, coff=2, head_dim=3, extra_tokens=5, extra_rows=2),
    "no_segments_no_rows": PackSpec((), ratio=4, coff=1, head_dim=3),
    "zero_tokens": PackSpec((0,), ratio=2, coff=2, head_dim=4, extra_rows=3),
    "zero_tokens_zero_rows": PackSpec((0, 0), ratio=2, coff=1, head_dim=4),
    "tokens_but_zero_rows": PackSpec((3, 1, 2), ratio=4, coff=2, head_dim=2, extra_tokens=1),
}


@pytest.mark.parametrize("case", list(DEGENERATE))
@pytest.mark.parametrize("total_comp", ["capacity", None], ids=["static", "true_count"])
def test_degenerate_inputs(case, total_comp):
    spec = DEGENERATE[case]
    pack = make_pack(spec)
    grad_out = pack.grad_out(total_comp)
    actual = op_forward_backward(pack, grad_out, total_comp)
    expected = eager_forward_backward(pack, grad_out, total_comp)
    rows = spec.capacity if total_comp == "capacity" else spec.true_rows
    assert actual[0].shape == (rows, spec.head_dim)
    assert bool((actual[0][spec.true_rows:] == 0).all())
    for name, a, e in zip(("out", "grad_kv", "grad_score", "grad_ape"), actual, expected):
        assert_bitwise_equal(a, e, name)
    if spec.true_rows == 0:
        assert all(bool((g == 0).all()) for g in actual[1:])


def test_meta_tensors_give_output_shapes():
    cu = _meta(4, dtype=torch.int32)
    out = torch.ops.csa.compressor(_meta(T, WIDTH), _meta(T, WIDTH), _meta(2, WIDTH), cu, cu,
                                   2, 2, 9)
    assert out.shape == (9, PACK.head_dim) and out.device.type == "meta"
    grads = torch.ops.csa.compressor_backward(_meta(9, PACK.head_dim), _meta(T, WIDTH),
                                              _meta(T, WIDTH), _meta(2, WIDTH), cu, cu, 2, 2)
    assert [tuple(g.shape) for g in grads] == [(T, WIDTH), (T, WIDTH), (2, WIDTH)]


def test_double_backward_says_it_is_not_implemented():
    pack = make_pack(PACK)
    kv = pack.kv.detach().requires_grad_()
    out = torch.ops.csa.compressor(kv, pack.score, pack.ape, pack.cu_seqlens,
                                   pack.cu_seqlens_comp, PACK.ratio, PACK.coff, PACK.capacity)
    (grad_kv,) = torch.autograd.grad(out.sum(), kv, create_graph=True)
    with pytest.raises(NotImplementedError, match=r"csa\.compressor_backward: double backward"):
        grad_kv.sum().backward()
