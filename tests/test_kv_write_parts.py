"""The K/V write lowering's per-layer fallback: where a draft's layers are not all alike (one without k_norm, one
whose K the op cannot compute, K and V of one layer from one fused GEMM), the layers the op writes alike still
lower, one op per kind, and the rest stay as they were; the caches always equal eager's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark_fx.report import KVKeptReason
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

OP = "dspark.multi_linear_kv_write"
ALWAYS = {"kv_write_op": "always", "fuse_on_cpu": True}
HIDDEN, HEADS, HEAD_DIM, LAYERS, SLOTS = 64, 2, 16, 4, 32


class Draft(nn.Module):
    """`LAYERS` layers writing K (RMSNorm per head, neox RoPE from a `[cos | sin]` table) and V from one activation;
    `odd` changes layer 1: "no_norm" (K rotated, not normed), "plain" (K neither normed nor rotated), "clamp" (K
    clamped after its norm: not the op's formula), "fused" (every layer's K and V from one fused k/v linear, layer 1
    without norm)."""

    def __init__(self, odd: str) -> None:
        super().__init__()
        self.odd = odd
        kv = HEADS * HEAD_DIM
        if odd == "fused":
            self.kv = nn.ModuleList(nn.Linear(HIDDEN, 2 * kv, bias=False) for _ in range(LAYERS))
        else:
            self.k = nn.ModuleList(nn.Linear(HIDDEN, kv, bias=False) for _ in range(LAYERS))
            self.v = nn.ModuleList(nn.Linear(HIDDEN, kv, bias=False) for _ in range(LAYERS))
        angles = torch.arange(64.0)[:, None] * 10000 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=1))
        for i in range(LAYERS):
            self.register_buffer(f"k_cache_{i}", torch.randn(SLOTS, HEADS, HEAD_DIM))
            self.register_buffer(f"v_cache_{i}", torch.randn(SLOTS, HEADS, HEAD_DIM))

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, f"{kind}_cache_{i}") for i in range(LAYERS) for kind in "kv"]

    def _rope(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        a, b = k.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def forward(self, ctx: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor) -> None:
        for i in range(LAYERS):
            if self.odd == "fused":
                k, v = self.kv[i](ctx).chunk(2, dim=-1)
            else:
                k, v = self.k[i](ctx), self.v[i](ctx)
            k, v = k.view(-1, HEADS, HEAD_DIM), v.view(-1, HEADS, HEAD_DIM)
            odd = i == 1
            if not (odd and self.odd in ("no_norm", "plain", "fused")):
                k = F.rms_norm(k, (HEAD_DIM,), eps=1e-6)
            if odd and self.odd == "clamp":
                k = k.clamp(-1, 1)
            if not (odd and self.odd == "plain"):
                k = self._rope(k, positions)
            getattr(self, f"k_cache_{i}")[loc] = k
            getattr(self, f"v_cache_{i}")[loc] = v


def _run(odd: str, inner: str = "aot_eager") -> CaptureBackend:
    torch._dynamo.reset()
    eager = Draft(odd)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS, inner=inner)
    compiled = torch.compile(model, backend=capture)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens in (5, 1):
            args = (
                torch.randn(tokens, HIDDEN, generator=gen),
                torch.randint(0, 64, (tokens,), generator=gen),
                torch.randperm(SLOTS, generator=gen)[:tokens],
            )
            eager(*args)
            compiled(*args)
            assert_close_for_dtype(model.caches(), eager.caches())
    return capture


def _layers_per_op(capture: CaptureBackend) -> list[list[int]]:
    counts = []
    for graph, report in zip(capture.after, capture.reports, strict=True):
        assert op_counts(graph)[OP] == len(report.kv_writes), str(report)
        counts.append(sorted(len(w.layers) for w in report.kv_writes))
    return counts


@pytest.mark.parametrize(("odd", "layers"), [("no_norm", [1, 3]), ("plain", [1, 3]), ("fused", [1, 3])])
def test_a_layer_unlike_the_others_is_lowered_apart(odd, layers):
    """Layer 1's K not normed (rotated, or neither: then it pairs with its V as two plain writes), or from a fused
    k/v linear (its K pairs with the V of its own GEMM, which must lower with it): two ops, nothing kept."""
    capture = _run(odd)
    assert all(c == layers for c in _layers_per_op(capture)), str(capture.report)
    assert not capture.report.kv_kept, str(capture.report)


def test_a_write_the_op_cannot_compute_leaves_the_others_lowered():
    """Layer 1's K is clamped after its norm: that write stays as it was with the reason, layer 1's V too (no K
    left to pair it with), and the other three layers lower in one op."""
    capture = _run("clamp")
    assert all(c == [3] for c in _layers_per_op(capture)), str(capture.report)
    kept = {k.cache: k.reason for k in capture.report.kv_kept}
    assert set(kept) == {"k_cache_1", "v_cache_1"}, str(capture.report)
    assert kept["v_cache_1"] is KVKeptReason.LAYERS_DIFFER


@pytest.mark.slow
def test_two_ops_in_one_graph_compile_through_inductor():
    """Inductor's codegen of a graph holding two of the ops (layer 1 apart): eager's caches."""
    capture = _run("no_norm", inner="inductor")
    assert all(c == [1, 3] for c in _layers_per_op(capture)), str(capture.report)


class VllmBuffers(nn.Module):
    """vLLM's `[2, pages, page, h, d]` buffer per layer, V written before K; layer 1's K not normed."""

    def __init__(self) -> None:
        super().__init__()
        kv = HEADS * HEAD_DIM
        self.k = nn.ModuleList(nn.Linear(HIDDEN, kv, bias=False) for _ in range(LAYERS))
        self.v = nn.ModuleList(nn.Linear(HIDDEN, kv, bias=False) for _ in range(LAYERS))
        for i in range(LAYERS):
            self.register_buffer(f"kv_cache_{i}", torch.randn(2, SLOTS // 4, 4, HEADS, HEAD_DIM))

    def forward(self, ctx: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor) -> None:
        for i in range(LAYERS):
            key_cache, value_cache = getattr(self, f"kv_cache_{i}").unbind(0)
            value_cache.view(-1, HEADS, HEAD_DIM)[loc] = self.v[i](ctx).view(-1, HEADS, HEAD_DIM)
            k = self.k[i](ctx).view(-1, HEADS, HEAD_DIM)
            key_cache.view(-1, HEADS, HEAD_DIM)[loc] = k if i == 1 else F.rms_norm(k, (HEAD_DIM,), eps=1e-6)


def test_k_and_v_of_one_buffer_stay_together_when_v_is_written_first():
    """The K of each layer pairs with the V written into its own `[2, ...]` buffer (the two share one `copy_` and
    lower together), not with the nearest plain write (the next layer's V): three normed layers in one op, layer 1
    (K and V plain) in another; eager's caches."""
    torch._dynamo.reset()
    eager = VllmBuffers()
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(5, HIDDEN, generator=gen), torch.zeros(5, dtype=torch.long), torch.randperm(SLOTS)[:5])
    with torch.no_grad():
        eager(*args)
        torch.compile(model, backend=capture)(*args)
    assert_close_for_dtype(list(model.buffers()), list(eager.buffers()))
    assert _layers_per_op(capture) == [[1, 3]], str(capture.report)


class SliceWriter(nn.Module):
    """Caches passed in, written at `cache[start : start + T]`; `odd`: layer 1's K not normed."""

    def __init__(self, odd: bool) -> None:
        super().__init__()
        self.odd = odd
        self.k = nn.ModuleList(nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False) for _ in range(LAYERS))
        self.v = nn.ModuleList(nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False) for _ in range(LAYERS))

    def forward(self, ctx: torch.Tensor, start: int, *caches: torch.Tensor) -> None:
        end = start + ctx.shape[0]
        for i in range(LAYERS):
            k = self.k[i](ctx).view(-1, HEADS, HEAD_DIM)
            caches[2 * i][start:end] = k if self.odd and i == 1 else F.rms_norm(k, (HEAD_DIM,), eps=1e-6)
            caches[2 * i + 1][start:end] = self.v[i](ctx).view(-1, HEADS, HEAD_DIM)


@pytest.mark.parametrize(("odd", "layers"), [(False, [LAYERS]), (True, [1, LAYERS - 1])], ids=["alike", "odd"])
def test_slice_writes_at_a_symbolic_start_under_dynamic_true(odd, layers):
    """Under `dynamic=True` the slice bounds and the caches' sizes are SymInts, which do not hash: comparing the
    layers' slots and shapes raised out of the pass (`unhashable type: non-nested SymInt`); now they lower, one op
    (or one per kind), with eager's caches."""
    torch._dynamo.reset()
    eager = SliceWriter(odd)
    capture = CaptureBackend(ALWAYS)
    compiled = torch.compile(copy.deepcopy(eager), backend=capture, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tokens, start in ((5, 3), (4, 7)):
            want = [torch.randn(SLOTS, HEADS, HEAD_DIM, generator=gen) for _ in range(2 * LAYERS)]
            got = [c.clone() for c in want]
            x = torch.randn(tokens, HIDDEN, generator=gen)
            eager(x, start, *want)
            compiled(x, start, *got)
            assert_close_for_dtype(got, want)
    assert all(c == layers for c in _layers_per_op(capture)), str(capture.report)
