"""dspark::multi_linear: reference vs an fp64 formula, opcheck, edge sizes, strided input, errors."""

import pytest
import torch
from multi_linear_cases import MULTI_LINEAR_BAD_INPUTS, fp64_formula, multi_linear_bad_args
from multi_linear_cases import multi_linear_case as _case

import custom_ops  # noqa: F401
from custom_ops.linear.multi_linear import multi_linear_reference

op = torch.ops.dspark.multi_linear


@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_formula(tokens, dtype):
    args = _case(tokens, dtype)
    out = op(*args)
    assert out.shape == (tokens, 39) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), fp64_formula(*args), rtol=tol, atol=tol * 8)


def test_reference_is_the_registered_cpu_kernel():
    args = _case()
    torch.testing.assert_close(op(*args), multi_linear_reference(*args), rtol=0, atol=0)


def test_strided_activation():
    x, *rest = _case(tokens=6)
    wide = torch.randn(6, 48)
    wide[:, ::2] = x
    torch.testing.assert_close(op(wide[:, ::2], *rest), op(x, *rest), rtol=0, atol=0)


def test_in_place_weight_update_is_seen():
    x, weights, starts, counts, biases = _case()
    before = op(x, weights, starts, counts, biases)
    with torch.no_grad():
        weights[1].mul_(2)
    after = op(x, weights, starts, counts, biases)
    torch.testing.assert_close(after[:, 16:32], 2 * before[:, 16:32] - biases[1].expand(5, 16), rtol=1e-5, atol=1e-5)


def test_opcheck():
    torch.library.opcheck(op, _case())
    torch.library.opcheck(op, _case(tokens=0))


@pytest.mark.parametrize("case", MULTI_LINEAR_BAD_INPUTS, ids=lambda c: c[0])
def test_bad_inputs(case):
    _, mutate, error, match, _ = case
    args = multi_linear_bad_args(mutate)
    with pytest.raises(error, match=match):
        op(*args)


def test_empty_row_ranges_and_zero_k():
    x, weights, starts, _, biases = _case(tokens=4)
    expected = fp64_formula(x, weights, starts, [16, 0, 7], biases)
    torch.testing.assert_close(op(x, weights, starts, [16, 0, 7], biases).double(), expected, rtol=1e-5, atol=1e-5)
    assert op(x, weights, starts, [0, 0, 0], biases).shape == (4, 0)
    empty_k = [w[:, :0] for w in weights]
    out = op(x[:, :0], empty_k, starts, [16, 16, 7], biases)
    expected = torch.cat([torch.zeros(4, 16), biases[1][:16].expand(4, 16), biases[2][2:9].expand(4, 7)], dim=1)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_symbolic_tokens_under_compile():
    """The fake impl's shape follows x.shape[0]: one dynamic graph serves every T."""
    x, *rest = _case(tokens=5)
    compiled = torch.compile(lambda x: op(x, *rest), backend="aot_eager", dynamic=True, fullgraph=True)
    for tokens in (5, 9, 64):
        xt = torch.randn(tokens, x.shape[1])
        torch.testing.assert_close(compiled(xt), op(xt, *rest), rtol=0, atol=0)


def test_cuda_calls_reach_the_library_entry():
    """CUDA calls go through the build-on-first-use entry (custom_ops._library) to the C++ kernels."""
    for name in ("dspark::multi_linear", "dspark::_multi_linear_variant"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("dspark::multi_linear", "CPU")


def test_variant_op_is_cuda_only():
    with pytest.raises(NotImplementedError, match="CUDA"):
        torch.ops.dspark._multi_linear_variant(*_case(), 0, 0)


def _grads(fn, x, weights, biases):
    """`fn(x, weights, biases).sum() * 1.5` differentiated: the gradients of x, each weight and each bias."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, *weights, *biases)]
    n = len(weights)
    (fn(leaves[0], leaves[1 : 1 + n], leaves[1 + n :]).sum() * 1.5).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_the_formulas(dtype):
    """Backward: x's gradient sums every range's block against its rows, a weight's gradient fills its used rows
    (zeros elsewhere; the same weight passed twice adds up), a bias's its used rows; against autograd of the formula
    in fp64. opcheck with inputs that need gradients."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 24, generator=gen).to(dtype)
    shared = torch.randn(20, 24, generator=gen).to(dtype)
    weights = [shared, torch.randn(9, 24, generator=gen).to(dtype), shared]
    biases = [torch.randn(n, generator=gen).to(dtype) for n in (20, 9, 20)]
    starts, counts = [2, 0, 10], [6, 9, 7]

    def formula(x, ws, bs):
        blocks = zip(ws, bs, starts, counts, strict=True)
        return torch.cat([x @ w[s : s + c].T + b[s : s + c] for w, b, s, c in blocks], 1)

    got = _grads(lambda x, ws, bs: op(x, ws, starts, counts, bs), x, weights, biases)
    want = _grads(formula, x.double(), [w.double() for w in weights], [b.double() for b in biases])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol * w.abs().max().item())
    assert not got[1][:2].any() and not got[1][8:].any()  # rows of the first range only: 2..7
    need = [x.requires_grad_(), [w.clone().requires_grad_() for w in weights], starts, counts, biases]
    torch.library.opcheck(op, tuple(need))


def test_a_bias_list_with_none_cannot_carry_gradients():
    """torch.library differentiates a tensor list only when every entry is a tensor: a bias that needs a gradient
    next to a None, in a call that x or a weight makes differentiable, raises naming biases (its gradient would be
    dropped otherwise; docs/ops.md)."""
    x, w = torch.randn(3, 8, requires_grad=True), [torch.randn(4, 8), torch.randn(4, 8)]
    with pytest.raises(ValueError, match="biases needs a gradient but holds None entries"):
        op(x, w, [0, 0], [4, 4], [None, torch.randn(4, requires_grad=True)])
    assert op(x, w, [0, 0], [4, 4], [None, torch.randn(4)]).shape == (3, 8)
