"""Each batching rule computes, for every branch, exactly what the branch computed — or the branch keeps its own
ops with a reason. Every model here compiles with the pass (no Inductor codegen) and is compared with eager."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dspark_fx
from dspark_fx import DsparkConfig, FusionReport, explain
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype


class Branches(nn.Module):
    """`n` GEMMs on one input, each reshaped to `[T, 4, 8]` and passed through `tail(model, i, k, *extra)`."""

    def __init__(self, n, tail):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(n))
        self.vecs = nn.ParameterList(nn.Parameter(torch.rand(8) + 0.5) for _ in range(n + 1))
        self.tail = tail

    def forward(self, x, *extra):
        return [self.tail(self, i, lin(x).view(-1, 4, 8), *extra) for i, lin in enumerate(self.lins)]


def _check(model, *inputs, config=None, inner="aot_eager"):
    torch._dynamo.reset()
    capture = CaptureBackend(config, inner=inner)
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=capture)(*inputs), model(*inputs))
    (group,) = capture.report.groups
    return group


def _report_of(group) -> FusionReport:
    return FusionReport(groups=[group])


def _batched(group) -> list[str]:
    return [op for c in group.classes for op in c.ops]


X = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("n", [2, 3])
def test_indices_separated_by_a_slice(n):
    """`k[i0, :, i2]` puts the index dims first; with as many indices as branches the sizes coincide."""
    i0, i2 = torch.tensor([4, 0, 3][:n]), torch.tensor([7, 1, 5][:n])
    group = _check(Branches(n, lambda m, i, k, a, b: k[a, :, b] * 2), X, i0, i2)
    assert "aten.index" in _batched(group)


@pytest.mark.parametrize(
    "index",
    [
        lambda k, a, b: k[a],
        lambda k, a, b: k[:, a % 4],
        lambda k, a, b: k[:, a % 4, b],
        lambda k, a, b: k[a, a % 4],
        lambda k, a, b: k[a[:, None], :, b],
        lambda k, a, b: k[None, a, ..., b],
        lambda k, a, b: k[a, None, :, b],
    ],
    ids=["first", "middle", "adjacent-pair", "leading-pair", "broadcast-separated", "none-separated", "none-inside"],
)
def test_advanced_indexing_forms(index):
    i0, i2 = torch.tensor([4, 0, 3]), torch.tensor([7, 1, 5])
    group = _check(Branches(3, lambda m, i, k, a, b: index(k, a, b) + 1), X, i0, i2)
    assert "aten.index" in _batched(group)


def test_index_that_differs_per_branch_is_not_batched():
    group = _check(Branches(2, lambda m, i, k, a: k[:, a + i]), X, torch.tensor([1, 2]))
    assert "aten.index" not in _batched(group)


@pytest.mark.parametrize(
    "reduce",
    [
        lambda k: k - k.mean(),
        lambda k: k * k.sum(),
        lambda k: k / k.amax(),
        lambda k: k - k.var(),
        lambda k: k - k.sum(dim=[]),
        lambda k: k - k.amax(dim=(0, -1), keepdim=True),
        lambda k: k.mean(dim=(0, 1)) * 3,
        lambda k: k - k.sum(-1, keepdim=True).sum(),
    ],
    ids=["mean-all", "sum-all", "amax-all", "var-all", "sum-dim-empty", "amax-keepdim", "mean-dims", "sum-chain"],
)
def test_reductions_reduce_each_branch_only(reduce):
    group = _check(Branches(3, lambda m, i, k: reduce(k)), X)
    assert len(group.classes) == 1 and not group.unbatched, group


@pytest.mark.parametrize(
    "op",
    [
        lambda k: k.flatten(),
        lambda k: k.flatten(1),
        lambda k: k.transpose(0, 1).reshape(4, -1),
        lambda k: k.split(2)[1] * 2,
        lambda k: k.unbind()[0] * 2,
        lambda k: torch.cat([k, k * 2]) + 1,
        lambda k: torch.stack([k, k + 1], -1).flatten(-2),
        lambda k: k[0, 0].expand(3, 8) * 2,
        lambda k: k[:, :1].squeeze() * 2,
        lambda k: k.permute(2, 0, -2).contiguous().view(8, -1),
        lambda k: F.softmax(k, dim=-1).cumsum(1),
        lambda k: k.unsqueeze(-1).expand(-1, -1, -1, 2) * 2,
    ],
    ids=[
        "flatten", "flatten-1", "transpose-reshape", "split-default-dim", "unbind-default-dim", "cat-default-dim",
        "stack-last", "expand-new-dims", "squeeze-all", "permute-view", "softmax-cumsum", "unsqueeze-expand",
    ],
)  # fmt: skip
def test_views_and_dim_ops(op):
    group = _check(Branches(3, lambda m, i, k: op(k)), X)
    assert len(group.classes) == 1 and not group.unbatched, group


def test_squeeze_of_a_symbolic_token_count():
    torch._dynamo.reset()
    model = Branches(3, lambda m, i, k: k[:, :1, :1].squeeze() * 2)
    capture = CaptureBackend()
    compiled = torch.compile(model, backend=capture)
    with torch.no_grad():
        for tokens in (5, 7):  # the second compile has a symbolic T
            x = torch.randn(tokens, 32)
            assert_close_for_dtype(compiled(x), model(x))
    (group,) = capture.reports[-1].groups
    assert "aten.squeeze" in _batched(group) and not group.unbatched, group


def test_one_leaf_node_at_two_positions_stacks_each_position():
    """Branch 0 reads its vector twice where the others read two different ones: `where(c, w0, w0)`."""

    def tail(m, i, k):
        a, b = (m.vecs[0], m.vecs[0]) if i == 0 else (m.vecs[i], m.vecs[i + 1])
        return torch.where((k * 0).bool(), a, b)

    group = _check(Branches(3, tail), X)
    assert "aten.where" in _batched(group)


def test_flatten_works_in_every_pass_only_mode():
    model = Branches(2, lambda m, i, k: (k * m.vecs[i]).flatten())
    report = explain(model, X)
    assert [c.branches for c in report.groups[0].classes] == [[0, 1]]
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend=dspark_fx.make_backend(inner="aot_eager"))
        assert_close_for_dtype(compiled(X), model(X))


def test_a_flattened_gemm_output_fuses_without_batching():
    """A column block of the fused GEMM output cannot be viewed flat; the flattening view becomes a reshape."""
    group = _check(Branches(2, lambda m, i, k: k.flatten()), X, config=DsparkConfig(batch_regions=False))
    assert len(group.branches) == 2 and not group.classes


def test_a_value_read_through_as_strided_keeps_its_own_layout():
    """`as_strided` reads storage: neither a column block of the fused GEMM nor a branch slice of a batched value
    may stand in for the tensor it was traced on."""
    group = _check(Branches(3, lambda m, i, k: (k * 2).as_strided((8, 8), (8, 1)) + 1), X)
    (cls,) = group.classes
    assert cls.ops == ["aten.view"] and "as_strided" in cls.kept[0], group

    class Strided(nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(2))

        def forward(self, x):
            return [lin(x).as_strided((8, 8), (8, 1)) + 1 for lin in self.lins]

    torch._dynamo.reset()
    model, capture = Strided(), CaptureBackend()
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=capture)(X), model(X))
    assert capture.report.n_groups == 0 and "as_strided" in capture.report.rejected[0].reason


def test_dtype_promotion_by_a_zero_dim_value_is_not_batched():
    """`bf16 * fp32 0-d` stays bf16; batched, the 0-d value gets dims and would promote to fp32."""

    def tail(m, i, k):
        kb = k.to(torch.bfloat16)
        return kb * kb.float().sum()

    group = _check(Branches(2, tail), X)
    (cls,) = group.classes
    assert "aten.sum" in cls.ops and "aten.mul" not in cls.ops, group
    assert len(cls.kept) == 1 and "type promotion" in cls.kept[0], group


def test_a_zero_dim_integer_factor_per_branch_is_not_batched():
    """`fp16 * int64 0-d` (70000) is fp16 either way, but eager multiplies by 70000 in fp32 where the stacked factor
    would be cast to fp16 first (inf): not batched, eager's values."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(2))
            for i in range(2):
                self.register_buffer(f"scale_{i}", torch.tensor(70000 + i))

        def forward(self, x):
            return [lin(x) * getattr(self, f"scale_{i}") for i, lin in enumerate(self.lins)]

    group = _check(Scaled().half(), (X * 0.01).half())
    assert "aten.mul" not in _batched(group), group
    assert not group.classes and len(group.unbatched) == 2, group
    assert all("reads a 0-d torch.int64 value per branch" in u.reason for u in group.unbatched), group


def test_constants_that_differ_only_in_the_sign_of_zero_are_not_one_class():
    """`reciprocal(k * 0.0)` and `reciprocal(k * -0.0)` are infinities of opposite signs: two branches, not one
    computation with the first branch's constant."""

    class SignedZeros(nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = nn.ModuleList(nn.Linear(32, 32, bias=False) for _ in range(2))

        def forward(self, x):
            return [torch.reciprocal(lin(x) * zero) for lin, zero in zip(self.lins, (0.0, -0.0), strict=True)]

    torch._dynamo.reset()
    model, capture = SignedZeros(), CaptureBackend()
    with torch.no_grad():
        got, want = torch.compile(model, backend=capture)(X), model(X)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_an_op_no_rule_batches_stays_per_branch_with_what_follows():
    """A boolean-mask index has a data-dependent shape: the ops before it are batched, it and its users are not."""
    x, mask = torch.randn(5, 32), torch.tensor([True, False, True, True, False])
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        group = _check(Branches(3, lambda m, i, k, mk: (k * m.vecs[i])[mk] * 2), x, mask)
    (cls,) = group.classes
    assert cls.ops == ["aten.view", "aten.mul"] and "boolean mask" in cls.kept[0], group
    assert "kept per branch from aten.index" in str(_report_of(group))


@pytest.mark.slow
@pytest.mark.parametrize(
    "op",
    [
        lambda k: k * 0.5 + 1,
        lambda k: k.unsqueeze(1).expand(-1, 2, -1, -1) + 1,
        lambda k: k - k.mean(),
        lambda k: k.split(2)[1] * 2,
        lambda k: F.rms_norm(k, (8,), None, 1e-6),
    ],
    ids=["add-scalar", "expand", "mean-all", "split-default-dim", "rms_norm"],
)
def test_batched_ops_lower_in_inductor(op):
    """Batched ops are emitted the way the branch passed its arguments (Inductor's lowerings do not take every
    schema default, e.g. `alpha` or `implicit`)."""
    group = _check(Branches(3, lambda m, i, k: op(k)), X, inner="inductor")
    assert len(group.classes) == 1 and not group.unbatched, group
