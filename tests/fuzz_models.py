"""Random multi-branch models for the differential fuzz of the horizontal fusion (`test_pass_fuzz.py`).

`make_case(seed)` draws a `ModelSpec` (everything follows from the seed) and builds its `FuzzModel`: N parallel
branches (1..6) on one input `x`, each

    projection → heads → norm → RoPE → 0-3 shape-keeping ops → [reads the previous branch] → a final op → output

picked from the menus below. Most branches copy a template branch (so they can batch); the others differ from it
in one aspect (so classes split), some of them decoys that must never fuse or batch: a computed or dequantized
weight, another input, an op that reads the previous branch. Drawn per branch, without changing its ops: whether
`where_vecs` reads one parameter twice and whether `scale_vec` reads the model's parameter (other leaves behind
the same ops). Index tensors are often as long as there are branches (sizes that coincide with K), and the
final op leans to the tricky ones (advanced indexing, squeeze, expand, flatten, full reductions). Outputs
are returned or written into registered cache buffers (`index_put`, `index_copy_`, slice assignment).

    python tests/fuzz_models.py 17      # print the spec of seed 17
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from dspark_fx.passes.graph_utils import propagate_val, shape_key
from dspark_fx.reference_draft import apply_rope, rope_cos_sin_table

PROJ = ("linear", "linear_bias", "row_slice", "row_slice_bias", "fused_split", "kv_slice_split")
DECOY_PROJ = ("computed_weight", "dequant", "other_input")
HEADS = ("view", "reshape", "unflatten")
NORM = ("none", "manual", "rms_norm", "rms_norm_noweight", "layer_norm_like")
ROPE = ("none", "neox", "gptj", "partial_neox", "partial_gptj")
MID = (
    "silu", "relu", "tanh", "sigmoid", "gelu", "sub_mean_all", "mul_sum_all", "div_amax_all", "var_all", "softmax",
    "log_softmax", "cumsum", "flip", "scale_vec", "scale_scalar", "bias_table", "const", "clamp", "bf16_roundtrip",
    "transpose_roundtrip", "where_mask", "other_input_gate", "sum_keepdim", "prod_last", "where_vecs",
)  # fmt: skip
FINAL = (
    "none", "flatten", "flatten1", "index_tok", "index_sep", "index_head", "index_pair", "index_none", "sum_all",
    "mean_tok", "amax_last", "transpose", "permute_reshape", "split_last", "unbind_head", "cat_self", "stack_neg",
    "expand_head", "select_last", "var_keepdim", "index_select_head", "squeeze_all", "unsqueeze_expand",
)  # fmt: skip
TRICKY_FINAL = (
    "index_sep", "index_pair", "index_none", "index_tok", "index_head", "index_select_head", "squeeze_all",
    "expand_head", "unsqueeze_expand", "flatten", "sum_all", "transpose", "permute_reshape",
)  # fmt: skip
OUTPUT = ("return", "index_put", "index_copy", "slice_assign")
HIDDEN, SLOTS, MAX_POSITION = 32, 24, 64


@dataclass(frozen=True)
class BranchSpec:
    proj: str = "linear"
    heads: int = 2
    view: str = "view"
    norm: str = "none"
    eps: float = 1e-6
    rope: str = "none"
    theta: float = 1e4
    mid: tuple[str, ...] = ()
    tied_vecs: bool = False  # `where_vecs` reads one parameter twice (drawn per branch: the same ops)
    shared_vec: bool = False  # `scale_vec` reads a parameter of the model, not of the branch (drawn per branch)
    reads_previous: bool = False
    final: str = "none"
    output: str = "return"
    v_output: str = "return"  # for projections that also give a V part


@dataclass(frozen=True)
class ModelSpec:
    seed: int
    head_dim: int
    q_rows: int
    n_index: int  # length of the index tensors (often the branch count: sizes that coincide with K)
    branches: tuple[BranchSpec, ...] = field(default_factory=tuple)


def draw_spec(seed: int) -> ModelSpec:
    rng = random.Random(seed)
    head_dim = rng.choice((4, 8, 16))
    template = BranchSpec(
        proj=rng.choice(PROJ),
        heads=rng.choice((1, 2, 3, 4)),
        view=rng.choice(HEADS),
        norm=rng.choice(NORM),
        eps=rng.choice((1e-6, 1e-5)),
        rope=rng.choice(ROPE),
        mid=_draw_mid(rng),
        final=rng.choice(TRICKY_FINAL) if rng.random() < 0.4 else rng.choice(FINAL),
        output=rng.choice(OUTPUT),
        v_output=rng.choice(OUTPUT),
    )
    n = rng.choice((1, 2, 2, 3, 3, 4, 5, 6))
    branches = [template if i == 0 or rng.random() < 0.65 else _mutate(template, rng) for i in range(n)]
    branches = [replace(b, tied_vecs=rng.random() < 0.5, shared_vec=rng.random() < 0.3) for b in branches]
    n_index = rng.choice((1, 2, 3, n, n))
    return ModelSpec(seed, head_dim, rng.choice((0, 8, 16)), n_index, tuple(branches))


def _draw_mid(rng: random.Random) -> tuple[str, ...]:
    ops = [rng.choice(MID) for _ in range(rng.choice((0, 1, 1, 2, 3)))]
    if rng.random() < 0.25:  # per-branch leaves at two positions of one op
        ops.insert(rng.randrange(len(ops) + 1), "where_vecs")
    return tuple(ops)


def _mutate(spec: BranchSpec, rng: random.Random) -> BranchSpec:
    aspects = ("proj", "decoy", "heads", "view", "norm", "eps", "rope", "theta", "mid", "mix", "final", "out")
    aspect = rng.choice(aspects)
    if aspect == "proj":
        return replace(spec, proj=rng.choice(PROJ))
    if aspect == "decoy":
        return replace(spec, proj=rng.choice(DECOY_PROJ))
    if aspect == "heads":
        return replace(spec, heads=spec.heads * 2)
    if aspect == "view":
        return replace(spec, view=rng.choice(HEADS))
    if aspect == "norm":
        return replace(spec, norm=rng.choice(NORM))
    if aspect == "eps":
        return replace(spec, eps=spec.eps * 10)
    if aspect == "rope":
        return replace(spec, rope=rng.choice(ROPE))
    if aspect == "theta":
        return replace(spec, theta=5e5)
    if aspect == "mid":
        return replace(spec, mid=(*spec.mid, rng.choice(MID)))
    if aspect == "mix":
        return replace(spec, reads_previous=True)
    if aspect == "final":
        return replace(spec, final=rng.choice(FINAL))
    return replace(spec, output=rng.choice(OUTPUT))


class FuzzModel(nn.Module):
    """The model of a `ModelSpec`; `forward(x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask)`."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.branch_params = nn.ModuleList(_BranchParams(spec, b) for b in spec.branches)
        self.shared_vec = nn.Parameter(torch.rand(spec.head_dim) + 0.5)
        for b in spec.branches:
            rot = _rotary_dim(b, spec.head_dim)
            if b.rope != "none" and not hasattr(self, _table_name(b, rot)):
                self.register_buffer(_table_name(b, rot), rope_cos_sin_table(MAX_POSITION, rot, b.theta))
        probe = example_inputs(spec, 2, seed=0), example_inputs(spec, 3, seed=0)
        with torch.no_grad():
            shapes = [[(k.shape, None if v is None else v.shape) for k, v in self._finals(*x)] for x in probe]
        for i, b in enumerate(spec.branches):
            (k2, v2), (k3, _) = shapes[0][i], shapes[1][i]
            if b.output != "return" and tuple(k2[:1]) == (2,) and tuple(k3[:1]) == (3,):
                self.register_buffer(f"k_cache_{i}", torch.zeros(SLOTS, *k2[1:]))
            if v2 is not None and b.v_output != "return":
                self.register_buffer(f"v_cache_{i}", torch.zeros(SLOTS, *v2[1:]))

    def forward(self, x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask):
        outs = []
        finals = self._finals(x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask)
        for i, (k, v) in enumerate(finals):
            outs.append(self._write(f"k_cache_{i}", self.spec.branches[i].output, k, loc))
            if v is not None:
                outs.append(self._write(f"v_cache_{i}", self.spec.branches[i].v_output, v, loc))
        return [o for o in outs if o is not None]

    def _finals(self, x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask):
        ctx = _Context(x, x2, positions, tok_idx, head_idx, dim_idx, mask, self.shared_vec)
        mids, vs = [], []
        for b, params in zip(self.spec.branches, self.branch_params, strict=True):
            k, v = params.project(ctx)
            k = _heads(k, b, self.spec.head_dim)
            k = _norm(k, b, params)
            if b.rope != "none":
                table = getattr(self, _table_name(b, _rotary_dim(b, self.spec.head_dim)))[positions]
                k = apply_rope(k, table, "gptj" if b.rope.endswith("gptj") else "neox")
            for op in b.mid:
                k = _mid(k, op, params, ctx)
            if b.reads_previous and mids and mids[-1].shape == k.shape:
                k = k + 0.5 * mids[-1]
            mids.append(k)
            vs.append(None if v is None else v.reshape(v.shape[0], b.heads, -1))
        return [(_final(k, b.final, ctx), v) for k, b, v in zip(mids, self.spec.branches, vs, strict=True)]

    def _write(self, name: str, mode: str, value: torch.Tensor, loc: torch.Tensor) -> torch.Tensor | None:
        if not hasattr(self, name) or value.dim() == 0:
            return value
        cache = getattr(self, name)
        if mode == "index_put":
            cache[loc] = value
        elif mode == "index_copy":
            cache.index_copy_(0, loc, value)
        else:
            cache[: value.shape[0]] = value
        return None

    def caches(self) -> list[torch.Tensor]:
        return [b for name, b in self.named_buffers() if "cache" in name]


@dataclass
class _Context:
    x: torch.Tensor
    x2: torch.Tensor
    positions: torch.Tensor
    tok_idx: torch.Tensor
    head_idx: torch.Tensor
    dim_idx: torch.Tensor
    mask: torch.Tensor
    shared_vec: torch.Tensor


class _BranchParams(nn.Module):
    """One branch's parameters: its projection (by kind) and the small per-branch tensors of norms and ops."""

    def __init__(self, spec: ModelSpec, b: BranchSpec) -> None:
        super().__init__()
        self.b, self.q = b, spec.q_rows
        d, out = spec.head_dim, b.heads * spec.head_dim
        self.out = out
        scale = 1 / math.sqrt(HIDDEN)
        if b.proj in ("linear", "linear_bias", "other_input"):
            self.lin = nn.Linear(HIDDEN, out, bias=b.proj == "linear_bias")
        elif b.proj == "fused_split":
            self.lin = nn.Linear(HIDDEN, self.q + 2 * out, bias=bool(self.q % 16))
        elif b.proj == "dequant":
            w = torch.randn(out, HIDDEN) * scale
            s = w.abs().amax(1) / 127
            self.register_buffer("w_int8", torch.round(w / s[:, None]).to(torch.int8))
            self.w_scale = nn.Parameter(s)
        else:  # row slices of a larger weight, or a weight computed in the graph
            self.weight = nn.Parameter(torch.randn(self.q + 2 * out + 8, HIDDEN) * scale)
            if b.proj == "row_slice_bias":
                self.bias = nn.Parameter(torch.randn(self.q + 2 * out + 8) * 0.1)
        self.norm_w = nn.Parameter(torch.rand(d) + 0.5)
        self.vec = nn.Parameter(torch.rand(d) + 0.5)
        self.other_vec = self.vec if b.tied_vecs else nn.Parameter(torch.rand(d) - 1.5)
        self.scalar = nn.Parameter(torch.tensor(0.75))
        self.table = nn.Parameter(torch.randn(b.heads, d) * 0.1)

    def project(self, ctx: _Context) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, q, out = self.b, self.q, self.out
        if b.proj in ("linear", "linear_bias"):
            return self.lin(ctx.x), None
        if b.proj == "other_input":
            return self.lin(ctx.x2), None
        if b.proj == "fused_split":
            _, k, v = self.lin(ctx.x).split([q, out, out], dim=-1)
            return k, v
        if b.proj == "dequant":
            return F.linear(ctx.x, self.w_int8.float() * self.w_scale[:, None]), None
        if b.proj == "computed_weight":
            return F.linear(ctx.x, self.weight[q : q + out] * 2), None
        if b.proj == "kv_slice_split":
            k, v = F.linear(ctx.x, self.weight[q : q + 2 * out]).split([out, out], dim=-1)
            return k, v
        bias = self.bias[q : q + out] if b.proj == "row_slice_bias" else None
        return F.linear(ctx.x, self.weight[q : q + out], bias), None


def _rotary_dim(b: BranchSpec, head_dim: int) -> int:
    return head_dim // 2 if b.rope.startswith("partial") else head_dim


def _table_name(b: BranchSpec, rot: int) -> str:
    return f"cos_sin_{rot}_{int(b.theta)}"


def _heads(k: torch.Tensor, b: BranchSpec, d: int) -> torch.Tensor:
    if b.view == "view":
        return k.view(-1, b.heads, d)
    if b.view == "reshape":
        return k.reshape(k.shape[0], b.heads, d)
    return k.unflatten(-1, (b.heads, d))


def _norm(k: torch.Tensor, b: BranchSpec, p: _BranchParams) -> torch.Tensor:
    d = k.shape[-1]
    if b.norm == "manual":
        x = k.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + b.eps) * p.norm_w.float()).to(k.dtype)
    if b.norm == "rms_norm":
        return F.rms_norm(k, (d,), p.norm_w, b.eps)
    if b.norm == "rms_norm_noweight":
        return F.rms_norm(k, (d,), None, b.eps)
    if b.norm == "layer_norm_like":
        centered = k - k.mean(-1, keepdim=True)
        return centered * torch.rsqrt(k.var(-1, keepdim=True, unbiased=False) + b.eps) * p.norm_w
    return k


def _mid(k: torch.Tensor, op: str, p: _BranchParams, ctx: _Context) -> torch.Tensor:
    """A shape-keeping op on `[T, h, d]`."""
    simple = {
        "silu": F.silu, "relu": F.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu,
        "softmax": lambda t: F.softmax(t, dim=-1), "log_softmax": lambda t: F.log_softmax(t, dim=-1),
        "cumsum": lambda t: t.cumsum(-1), "flip": lambda t: t.flip(-1), "const": lambda t: t * 0.5 + 1,
        "clamp": lambda t: t.clamp(-1.5, 1.5), "sub_mean_all": lambda t: t - t.mean() * 0.5,
        "mul_sum_all": lambda t: t * (t.sum() * 0.01 + 1), "div_amax_all": lambda t: t / (t.abs().amax() + 1),
        "var_all": lambda t: t / (t.var() + 1), "bf16_roundtrip": lambda t: t.to(torch.bfloat16).float(),
        "transpose_roundtrip": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
        "sum_keepdim": lambda t: t - t.sum(dim=(0, 2), keepdim=True) * 0.1,
        "prod_last": lambda t: t * (1 + torch.tanh(t) / t.shape[-1]).prod(-1, keepdim=True),
    }  # fmt: skip
    # Kept well-conditioned, or a case would compare only values near 0, below the tolerance: prod_last multiplies d
    # factors in 1 ± 1/d, a product in [(1 - 1/d)^d, (1 + 1/d)^d] ⊂ [0.3, e) (a product of d tanh values falls
    # towards 0); mul_sum_all scales by 1 + sum/100, not by sum/100 (near 0 whenever the sum is); sub_mean_all
    # subtracts half the mean (all of it would make a later full sum exactly 0).
    if op in simple:
        return simple[op](k)
    if op == "scale_vec":
        return k * (ctx.shared_vec if p.b.shared_vec else p.vec)
    if op == "scale_scalar":
        return k * p.scalar
    if op == "bias_table":
        return k + p.table
    if op == "where_vecs":
        return torch.where(F.relu(k).to(torch.bool), p.vec, p.other_vec) * k
    if op == "where_mask":
        return torch.where(ctx.mask[:, None, : k.shape[-1]], k, k * 0.5)
    return k * torch.sigmoid(ctx.x2[:, None, : k.shape[-1]])  # other_input_gate


def _final(k: torch.Tensor, op: str, ctx: _Context) -> torch.Tensor:
    """The last op of a branch on `[T, h, d]`: index, reduce, reshape, split, cat, ..."""
    tok, head, dim = ctx.tok_idx, ctx.head_idx, ctx.dim_idx
    h, d = k.shape[1], k.shape[2]
    ops = {
        "none": lambda: k,
        "flatten": lambda: k.flatten(),
        "flatten1": lambda: k.flatten(1),
        "index_tok": lambda: k[tok],
        "index_sep": lambda: k[tok, :, dim % d],
        "index_head": lambda: k[:, head % h],
        "index_pair": lambda: k[tok, torch.arange(tok.shape[0]) % h],
        "index_none": lambda: k[:, None, head % h],
        "sum_all": lambda: k.sum() * k.mean(),
        "mean_tok": lambda: k.mean(0),
        "amax_last": lambda: k.amax(-1),
        "transpose": lambda: k.transpose(0, 1) * 2,
        "permute_reshape": lambda: k.permute(1, 2, 0).reshape(h * d, -1),
        "split_last": lambda: k.split(d // 2, -1)[1],
        "unbind_head": lambda: k.unbind(1)[0] * 2,
        "cat_self": lambda: torch.cat([k, k * 2], -1),
        "stack_neg": lambda: torch.stack([k, -k], 1),
        "expand_head": lambda: k[:, :1].expand(-1, 3, -1) * 2,
        "select_last": lambda: k[..., 0],
        "var_keepdim": lambda: k.var(-1, keepdim=True),
        "index_select_head": lambda: k.index_select(1, head % h),
        "squeeze_all": lambda: k[:, :1, :1].squeeze() * 2,  # [T], or 0-d at T=1
        "unsqueeze_expand": lambda: k.unsqueeze(1).expand(-1, 2, -1, -1) + 1,
    }
    return ops[op]()


def example_inputs(spec: ModelSpec, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`(x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask)` for `tokens` rows (distinct cache slots)."""
    gen = torch.Generator().manual_seed(seed * 1000 + tokens)
    return (
        torch.randn(tokens, HIDDEN, generator=gen),
        torch.randn(tokens, HIDDEN, generator=gen),
        torch.randint(0, MAX_POSITION, (tokens,), generator=gen),
        torch.randperm(SLOTS, generator=gen)[:tokens],
        torch.randint(0, tokens, (spec.n_index,), generator=gen),
        torch.randint(0, 64, (2,), generator=gen),
        torch.randint(0, 64, (spec.n_index,), generator=gen),
        torch.rand(tokens, spec.head_dim, generator=gen) < 0.5,
    )


@dataclass
class FuzzCase:
    spec: ModelSpec
    model: FuzzModel

    def inputs(self, tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        return example_inputs(self.spec, tokens, self.spec.seed + seed)


def make_case(seed: int) -> FuzzCase:
    spec = draw_spec(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = FuzzModel(spec)
    return FuzzCase(spec, model)


@torch.no_grad()
def update_weights(model: nn.Module, seed: int) -> None:
    """In-place updates of every parameter, as an optimizer step or a weight reload would do them."""
    gen = torch.Generator().manual_seed(seed)
    for i, p in enumerate(model.parameters()):
        if i % 2:
            p.mul_(1.25)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * p.abs().mean())


def describe(spec: ModelSpec) -> str:
    lines = [
        f"seed {spec.seed}: head_dim {spec.head_dim}, q_rows {spec.q_rows}, index length {spec.n_index}, "
        f"{len(spec.branches)} branch(es)"
    ]
    lines += [f"  {i}: {b}" for i, b in enumerate(spec.branches)]
    return "\n".join(lines)


# ---- KV writes through casts: fake quantization and dtype round trips ---------------------------------------------

CAST_KINDS = ("fp8", "fp16", "bf16", "widen")  # seed % 4 picks one, so every kind shows in a few seeds
CAST_AT = ("heads", "normed", "k", "v")


@dataclass(frozen=True)
class CastSpec:
    """A `CastKVModel`: `layers` layers writing K (projection, RMSNorm, neox RoPE) and V into caches, with the
    round trip `kind` at `at`: K after the heads view ("heads"), after the norm ("normed"), the K written ("k") or
    the V written ("v"). "fp8": through float8_e4m3fn (bf16 model); "fp16": through fp16 (bf16 model; every other
    such seed scales the activation by 1e6: values beyond fp16's range, inf and NaN in eager); "bf16": fp32 -> bf16
    -> fp32 (fp32 model); "widen": through fp32 and fp64 (a round trip that rounds nothing)."""

    seed: int
    kind: str
    at: str
    dtype: torch.dtype
    layers: int
    heads: int
    head_dim: int
    scale: float


def draw_cast_spec(seed: int) -> CastSpec:
    rng = random.Random(seed)
    kind = CAST_KINDS[seed % len(CAST_KINDS)]
    dtype = torch.float32 if kind == "bf16" or (kind == "widen" and rng.random() < 0.5) else torch.bfloat16
    at, scale = rng.choice(CAST_AT), 1.0
    if kind == "fp16" and seed % 8 == 1:  # before the norm or on V, values beyond fp16's range: inf, NaN in eager
        at, scale = rng.choice(("heads", "v")), 1e6
    return CastSpec(
        seed,
        kind,
        at,
        dtype,
        layers=rng.choice((1, 2, 3)),
        heads=rng.choice((1, 2)),
        head_dim=rng.choice((8, 16)),
        scale=scale,
    )


class CastKVModel(nn.Module):
    """The model of a `CastSpec`; `forward(x, positions, loc)` writes every layer's K and V at `loc`."""

    def __init__(self, spec: CastSpec) -> None:
        super().__init__()
        self.spec = spec
        kv = spec.heads * spec.head_dim
        self.projs = nn.ModuleList(nn.Linear(HIDDEN, 2 * kv, bias=i % 2 == 1) for i in range(spec.layers))
        self.norms = nn.ParameterList(nn.Parameter(torch.rand(spec.head_dim) + 0.5) for _ in range(spec.layers))
        self.register_buffer("cos_sin", rope_cos_sin_table(MAX_POSITION, spec.head_dim, 1e4))
        for i in range(spec.layers):
            for kind in "kv":
                self.register_buffer(f"{kind}_cache_{i}", torch.randn(SLOTS, spec.heads, spec.head_dim))
        self.to(spec.dtype)
        self.cos_sin = self.cos_sin.float()

    def _cast(self, at: str, t: torch.Tensor) -> torch.Tensor:
        if at != self.spec.at:
            return t
        through = {
            "fp8": (torch.float8_e4m3fn,),
            "fp16": (torch.float16,),
            "bf16": (torch.bfloat16,),
            "widen": (torch.float32, torch.float64),
        }[self.spec.kind]
        out = t
        for dtype in through:
            out = out.to(dtype)
        return out.to(t.dtype)

    def forward(self, x, positions, loc):
        s = self.spec
        x = x * s.scale
        kv = s.heads * s.head_dim
        for i, (proj, norm_w) in enumerate(zip(self.projs, self.norms, strict=True)):
            k, v = proj(x).split([kv, kv], dim=-1)
            k = self._cast("heads", k.view(-1, s.heads, s.head_dim))
            h = k.float()
            k = norm_w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(k.dtype)
            k = apply_rope(self._cast("normed", k), self.cos_sin[positions], "neox")
            getattr(self, f"k_cache_{i}")[loc] = self._cast("k", k)
            getattr(self, f"v_cache_{i}")[loc] = self._cast("v", v.view(-1, s.heads, s.head_dim))

    def caches(self) -> list[torch.Tensor]:
        return [b for name, b in self.named_buffers() if "cache" in name]


def cast_inputs(spec: CastSpec, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    """`(x, positions, loc)` for `tokens` rows (distinct slots)."""
    gen = torch.Generator().manual_seed(spec.seed * 1000 + seed * 10 + tokens)
    return (
        torch.randn(tokens, HIDDEN, generator=gen).to(spec.dtype),
        torch.randint(0, MAX_POSITION, (tokens,), generator=gen),
        torch.randperm(SLOTS, generator=gen)[:tokens],
    )


def make_cast_case(seed: int) -> CastKVModel:
    spec = draw_cast_spec(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return CastKVModel(spec)


# Case kinds beyond the plain model (`make_kind_case`): the same drawn model with something around it that the pass
# must keep working: "out_ops", a composed user post-grad pass that makes pointwise ops write into fresh buffers
# through their `.out` ops; "dense_reader", a custom op that reads branch values as dense memory.
CASE_KINDS = ("out_ops", "dense_reader")


@torch.library.custom_op("dspark_fuzz::dense_rows", mutates_args=())
def dense_rows(x: torch.Tensor) -> torch.Tensor:
    """`1.5 * x + 0.25` computed on `x`'s memory read as dense row-major rows from its storage offset, as a kernel
    taking `x.data_ptr()` does: right for a contiguous `x` only."""
    strides = torch._prims_common.make_contiguous_strides_for(x.shape)
    return torch.as_strided(x, x.shape, strides, x.storage_offset()) * 1.5 + 0.25


@dense_rows.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class DenseReaderModel(FuzzModel):
    """The spec's model with `dense_rows` reading, in the drawn `readers` branches, the projection (a column block of
    the fused GEMM), the normed heads (a slice of the batched norm) and the branch results (K, and V where there is
    one), each where eager has it contiguous. The projection and norm are computed again for the reads: the
    common-subexpression elimination makes them the branch's own nodes."""

    def __init__(self, spec: ModelSpec, readers: tuple[bool, ...]) -> None:
        object.__setattr__(self, "readers", readers)  # FuzzModel.__init__ runs `_finals` already
        super().__init__(spec)

    def forward(self, x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask):
        outs = super().forward(x, x2, positions, loc, tok_idx, head_idx, dim_idx, mask)
        ctx = _Context(x, x2, positions, tok_idx, head_idx, dim_idx, mask, self.shared_vec)
        for b, params, on in zip(self.spec.branches, self.branch_params, self.readers, strict=True):
            k, _ = params.project(ctx)
            outs += [_read(k, on), _read(_norm(_heads(k, b, self.spec.head_dim), b, params), on)]
        return outs

    def _finals(self, *inputs: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        finals = super()._finals(*inputs)
        return [
            (_read(k, on), None if v is None else _read(v, on)) for (k, v), on in zip(finals, self.readers, strict=True)
        ]


def _read(value: torch.Tensor, on: bool) -> torch.Tensor:
    return dense_rows(value) if on and value.is_contiguous() else value


class OutOpsPass:
    """A user post-grad pass, as a memory planner might write it: a drawn half of the pointwise ATen ops write their
    result into a fresh buffer through their `.out` op. The buffer is `empty`/`empty_strided` of a static result
    shape, or `empty_like` of the first value of the graph with the result's shape and dtype: the buffers of
    values of one shape have the same arguments, and many of those values are alive at once. `rewritten` counts
    the ops rewritten so far."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        rng = random.Random(self.seed)
        firsts: dict[str, torch.fx.Node] = {}  # the first value of each shape and dtype
        for node in list(graph.nodes):
            first = firsts.setdefault(shape_key(node), node) if isinstance(node.meta.get("val"), torch.Tensor) else None
            out_op = _out_overload(node)
            if out_op is None or rng.random() < 0.5:
                continue
            with graph.inserting_before(node):
                buffer = _buffer(graph, node, None if first is node else first, rng)
                if buffer is None:
                    continue
                propagate_val(graph, buffer)
                written = graph.call_function(out_op, node.args, {**node.kwargs, "out": buffer})
                propagate_val(graph, written)
            node.replace_all_uses_with(written)
            graph.erase_node(node)
            if first is node:
                firsts[shape_key(written)] = written
            self.rewritten += 1


def _out_overload(node: torch.fx.Node) -> torch._ops.OpOverload | None:
    """The `.out` overload of a pointwise functional ATen op: its arguments and an `out` it writes."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" or torch.Tag.pointwise not in op.tags:
        return None
    if op._schema.is_mutable or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        args = candidate._schema.arguments
        written = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
        if written == ["out"] and [(a.name, str(a.type)) for a in args if a.name != "out"] == want:
            return candidate
    return None


def _buffer(
    graph: torch.fx.Graph, node: torch.fx.Node, first: torch.fx.Node | None, rng: random.Random
) -> torch.fx.Node | None:
    """A buffer for `node`'s result: `empty_like(first)` (an earlier value of its shape and dtype), or `empty` or
    `empty_strided` of its static shape; None when there is neither."""
    aten = torch.ops.aten
    val = node.meta["val"]
    kwargs = {"dtype": val.dtype, "device": val.device}
    static = all(isinstance(s, int) for s in (*val.shape, *val.stride()))
    if first is not None and (not static or rng.random() < 0.4):
        return graph.call_function(aten.empty_like.default, (first,), {"memory_format": torch.contiguous_format})
    if not static:
        return None
    if rng.random() < 0.5:
        return graph.call_function(aten.empty.memory_format, ([*val.shape],), kwargs)
    return graph.call_function(aten.empty_strided.default, ([*val.shape], [*val.stride()]), kwargs)


def make_kind_case(seed: int, kind: str) -> tuple[FuzzCase, OutOpsPass | None]:
    """The case of `seed` as kind `kind` (`CASE_KINDS`), and the user post-grad pass to compose with the pass."""
    spec = draw_spec(seed)
    if kind == "out_ops":
        return make_case(seed), OutOpsPass(seed)
    if kind != "dense_reader":
        raise ValueError(f"make_kind_case: kind must be one of {CASE_KINDS}, got {kind!r}")
    rng = random.Random(seed)
    readers = tuple(rng.random() < 0.7 for _ in spec.branches)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DenseReaderModel(spec, readers)
    return FuzzCase(spec, model), None


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(describe(draw_spec(int(arg))))
