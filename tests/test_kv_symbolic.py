"""The symbolic element evaluation behind the KV-write lowering (`dspark_fx/passes/kv_symbolic.py`): different
spellings of one computation give the same expression ids, element for element; different computations do not.
Fast: graphs from `make_fx` (fake tensors), no compile."""

import numpy as np
import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_fx.passes.kv_symbolic import Algebra, Evaluation

T, H, D = 3, 2, 8


def _evaluate(fn, *shapes, dtype=torch.float32, decompose=False):
    """Trace `fn(x, cos, sin, w)` (x `[T, H*D]` stands for a GEMM output) and evaluate each output symbolically;
    `decompose`: with Inductor's decompositions, as in the post-grad graphs the pass sees (`roll` and `arange`
    become `index` and `iota`)."""
    args = [torch.randn(s, dtype=dtype) for s in shapes]
    table = select_decomp_table() if decompose else None
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=table)(*args)
    graph = gm.graph
    x = next(iter(graph.find_nodes(op="placeholder")))
    ev = Evaluation(T, dtype, {x})
    (out,) = graph.find_nodes(op="output")
    return [ev(node).ids for node in out.args[0]]


def _rope_spellings(x, cos, sin, w):
    k = x.view(T, H, D)
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = k.chunk(2, -1)
    by_chunk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    y1, y2 = k.split(D // 2, -1)
    by_split = torch.cat((-y2 * s + y1 * c, y1 * s + y2 * c), -1)
    cc, ss = torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]
    rotate_half = torch.cat((-k[..., D // 2 :], k[..., : D // 2]), -1)
    by_rotate_half = k * cc + rotate_half * ss
    z1, z2 = k.view(T, H, 2, D // 2).unbind(-2)
    by_unbind = torch.stack((z1 * c - z2 * s, z2 * c + z1 * s), -2).flatten(-2)
    hf = k.view(1, T, H, D).transpose(1, 2)  # [1, H, T, D]
    hf_rot = torch.cat((-hf[..., D // 2 :], hf[..., : D // 2]), -1)
    by_hf_layout = (hf * cc.transpose(0, 1)[None] + hf_rot * ss.transpose(0, 1)[None]).transpose(1, 2).reshape(T, H, D)
    return by_chunk, by_split, by_rotate_half, by_unbind, by_hf_layout


def test_rope_spellings_are_the_same_expressions():
    outs = _evaluate(_rope_spellings, (T, H * D), (T, D // 2), (T, D // 2), (D,))
    for i, ids in enumerate(outs[1:], 1):
        assert np.array_equal(ids, outs[0]), f"spelling {i} differs from chunk/cat"


def _rotate_half_spellings(x, cos, sin, w):
    k = x.view(T, H, D)
    half = D // 2
    by_cat = torch.cat((-k[..., half:], k[..., :half]), -1)
    by_roll = torch.roll(k, half, dims=-1) * torch.cat((-torch.ones(half), torch.ones(half)))
    first = torch.arange(D) < half
    by_where = torch.where(first, -torch.roll(k, -half, dims=-1), torch.roll(k, half, dims=-1))
    zeros = torch.zeros_like(k)
    by_scatter = torch.slice_scatter(zeros, -k[..., half:], dim=-1, start=0, end=half)
    by_scatter = torch.slice_scatter(by_scatter, k[..., :half], dim=-1, start=half, end=D)
    by_roll_one_more = torch.roll(k, half + 1, dims=-1) * torch.cat((-torch.ones(half), torch.ones(half)))
    by_mask_from_data = torch.where(k > 0, -torch.roll(k, -half, dims=-1), torch.roll(k, half, dims=-1))
    return by_cat, by_roll, by_where, by_scatter, by_roll_one_more, by_mask_from_data


def test_rotate_half_by_roll_where_or_slice_scatter_is_the_same_expressions():
    """`roll` (an `index` by `(iota + shift) % D` once decomposed), `where` over a mask of `arange`, and
    `slice_scatter` are index maps and a constant choice: the same elements as `cat`'s rotate_half. A roll one
    element further differs; a mask read from the data is not followed (a leaf, never a guess)."""
    by_cat, *same, one_more, from_data = _evaluate(_rotate_half_spellings, (T, H * D), (T,), (T,), (D,), decompose=True)
    for ids in same:
        assert np.array_equal(ids, by_cat)
    assert not np.array_equal(one_more, by_cat) and not np.array_equal(from_data, by_cat)


def _gptj_spellings(x, cos, sin, w):
    k = x.view(T, H, D)
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = k[..., ::2], k[..., 1::2]
    by_stack = torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
    angle = torch.atan2(sin, cos)
    freqs_cis = torch.polar(torch.ones_like(cos), angle)[:, None, :]
    by_complex = torch.view_as_real(torch.view_as_complex(k.reshape(T, H, D // 2, 2)) * freqs_cis).flatten(-2)
    angle = angle[:, None, :]
    by_polar_parts = torch.stack((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), -1)
    return by_stack, by_complex, by_polar_parts.flatten(-2)


def test_gptj_pairs_by_slices_and_by_complex_multiply_are_the_same_expressions():
    """A complex product is its real pairs; `polar(1, angle)` is `(cos angle, sin angle)`."""
    _, by_complex, by_polar_parts = _evaluate(_gptj_spellings, (T, H * D), (T, D // 2), (T, D // 2), (D,))
    assert np.array_equal(by_complex, by_polar_parts)


def _norm_spellings(x, cos, sin, w):
    k = x.view(T, H, D)
    eps = 1e-6
    by_rsqrt = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * w
    by_sqrt = w * (k / torch.sqrt((k * k).sum(-1, keepdim=True) / D + eps))
    eps_outside = k / (torch.sqrt(k.pow(2).mean(-1, keepdim=True)) + eps) * w
    over_heads = k * torch.rsqrt(k.pow(2).mean(-2, keepdim=True) + eps) * w
    return by_rsqrt, by_sqrt, eps_outside, over_heads


def test_norm_spellings_are_the_same_expressions_and_near_misses_are_not():
    by_rsqrt, by_sqrt, eps_outside, over_heads = _evaluate(_norm_spellings, (T, H * D), (T, D // 2), (T, D // 2), (D,))
    assert np.array_equal(by_rsqrt, by_sqrt)
    assert not np.any(eps_outside == by_rsqrt)
    assert not np.any(over_heads == by_rsqrt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_casts_are_left_out_only_where_they_round_nothing_the_op_keeps(dtype):
    """In a bf16 model, `.float()` and the cast back are left out; an fp16 round trip is not. In an fp32 model,
    a bf16 round trip is a rounding too."""

    def casts(x, cos, sin, w):
        k = x.view(T, H, D)
        return k.float().to(dtype), k.to(torch.float16).to(dtype), k.to(torch.bfloat16).to(dtype)

    plain, fp16, bf16 = _evaluate(casts, (T, H * D), (T, D // 2), (T, D // 2), (D,), dtype=dtype)
    assert not np.any(fp16 == plain)
    assert np.array_equal(bf16, plain) == (dtype == torch.bfloat16)


def _angle_spellings(x, inv_freq, positions, w):
    outer = positions[:, None] * inv_freq[None, :]
    matmul = (inv_freq[None, :, None].expand(1, -1, 1) @ positions[None, None, :]).transpose(1, 2)[0]
    projection = x @ w  # an inner dim of H * D: a projection, not expanded
    return outer.cos(), matmul.cos(), projection


def test_small_matmuls_are_sums_of_products_and_projections_stay_leaves():
    """HF's angles `inv_freq @ positions` (a bmm of inner dim 1) are the outer product's expressions; a matmul of a
    large inner dim is a leaf of its own."""
    args = [torch.randn(T, H * D), torch.randn(D // 2), torch.randn(T), torch.randn(H * D, 4)]
    graph = make_fx(_angle_spellings, tracing_mode="fake")(*args).graph
    x = next(iter(graph.find_nodes(op="placeholder")))
    ev = Evaluation(T, torch.float32, {x})
    (out,) = graph.find_nodes(op="output")
    outer, matmul, projection = (ev(node).ids for node in out.args[0])
    assert np.array_equal(outer, matmul)
    atoms = [ev.alg.single_atom(int(e)) for e in projection.reshape(-1)]
    assert all(a is not None and a[0] == "leaf" and a[1] is out.args[0][2] for a in atoms)


def test_a_sum_in_one_pass_is_the_polynomial_of_adding_one_by_one():
    """`Algebra.total` (the reductions and small matmuls) interns the same polynomial as adding the terms from zero
    one by one: terms sharing monomials (coefficients that sum, and a monomial that cancels and returns), products,
    scaled terms."""
    alg = Algebra()
    a, b, c = (alg.atom(("leaf", None, i)) for i in range(3))
    terms = [a, alg.mul(a, b), alg.scale(a, 0.1), alg.scale(alg.mul(a, b), -1.0), alg.scale(c, 1 / 3), b]
    terms += [alg.scale(alg.mul(a, b), 0.7), alg.add(c, a, -1.0), alg.power(alg.add(a, b), -0.5)]
    for count in range(len(terms) + 1):
        sequential = alg.zero
        for e in terms[:count]:
            sequential = alg.add(sequential, e)
        assert alg.total(terms[:count]) == sequential, count
