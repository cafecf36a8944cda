"""A whole DFlash-style draft step, written as plain HF-style modules: eager vs torch.compile vs dspark_backend
(and dspark_backend without batched regions: the same fused GEMMs, each layer's norm/RoPE on its slice; and with
`colocate_weights=True`: each fused group's weights moved into one allocation when it compiles), and the
same draft stacked by hand under plain torch.compile (`HandStackedDraft`: per layer one q/k/v and one gate/up
weight, the context K/V of all layers one weight; the weights concatenated once, as vLLM and sglang load them).

One forward is one draft step: a block of `BLOCK` tokens runs through every layer and attends to the block's own
K/V and to context K/V that every layer projects from the same `target_hidden [T, hidden]` with its own
`k_proj`/`v_proj` (5 layers x (k, v) = 10 GEMMs on one activation: what `dspark_backend` fuses into one
`dspark::multi_linear`, with one batched k_norm/RoPE; it also fuses each layer's q/k/v and gate/up GEMMs). Nothing
is cached across steps. Attention has no mask: every block query sees all T context tokens and all block tokens
(the block is bidirectional; one sequence, no padding). The context K is normed and roped at the context positions
before it is joined with the block's K, as an engine that writes the context K/V to its cache does.

Qwen3-8B draft dims (5 layers, hidden 4096, 32/8 heads x 128, intermediate 12288, bf16), block 16, T in {16, 512}.
T is marked dynamic, so each compiled variant compiles one graph for both T (the graph that automatic dynamic
shapes switch to at the second T anyway). Parity with eager is checked first; then every variant is captured in a
`torch.cuda.CUDAGraph`, one replay is checked against eager too, and the replays are timed interleaved
(`interleaved_median_us`: `ROUNDS` rounds, each variant once per round in a shuffled order after an L2 flush,
medians), with a control: the hand-stacked draft compiled a second time (its time ÷ the first's is what two compiles
of one model read apart in this run; Inductor's per-layer norm/RoPE kernels have taken 2 or 5 µs per launch from
compile to compile). The floor and the roofline bound
the step's GEMMs with the copy bandwidth and GEMM rate measured in the same run (`gemm_bounds`): each weight read
once, each GEMM's FLOPs over every row it multiplies. Under the table (CUDA), per T, what `TARGET_SPEEDUP` over
torch.compile asks of the step's GEMMs after dspark_backend's other kernels as profiled (µs and the average rate
over their weights), against the fastest way of running them measured in the same run: each compiled variant's GEMM
kernels (the hand-stacked compile's are cuBLAS on concatenated weights) and a kernel that only reads their weights
(`speedup_bound`).

Below the step table, per T and compiled variant, the step's GEMMs (`gemm_profile`): every GEMM op the compiled code
calls (`aten::mm`, `aten::addmm`, `dspark::multi_linear`) in `PROFILED_CALLS` profiled calls of the compiled model
(outside a CUDA graph; the GPU's kernel times do not depend on it), grouped by shape: calls per step, kernels per
call, µs per call (on CUDA the kernel time of the op and what it calls; on CPU its wall time) and its weight bytes ÷
the copy bandwidth ÷ that time (`% of copy`: 100 % is a GEMM that reads its weights at the copy rate). Under the
table: the kernels launched per step, all of them and the GEMMs', then (CUDA) the other kernels by name, the longest
first, with their launches and kernel time per step: where the step's time outside the GEMMs goes.

    python benchmarks/draft_step.py --out BENCH.md          # GPU: Qwen3-8B draft dims, bf16
    python benchmarks/draft_step.py --device cpu --small    # CPU check: tiny dims, fp32, wall-clock times
    python benchmarks/draft_step.py --device cpu --hidden 1024   # the same layout, larger
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import copy_bandwidth, gemm_rate, graphed, interleaved_median_us
from torch import nn

import dspark_fx
from dspark_fx.testing import TOLERANCES, CaptureBackend, assert_close_for_dtype, compile_counts, op_counts


@dataclass(frozen=True)
class DraftConfig:
    num_layers: int = 5
    hidden: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    rope_theta: float = 1e6
    eps: float = 1e-6


QWEN3_8B = DraftConfig()
SMALL = DraftConfig(num_layers=3, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128)
BLOCK = 16
CONTEXTS = (16, 512)
GEMM_OPS = ("aten.mm", "aten.addmm", "dspark.multi_linear")
PROFILED_CALLS = 5  # calls of a compiled model that `gemm_profile` profiles
TARGET_SPEEDUP = 1.3  # over torch.compile, what dspark_backend's step is measured against (`speedup_bound`)
READ = "a kernel that only reads their weights, back to back"  # `gemm_read_us` in `speedup_bound`'s line
OTHER_KERNEL_ROWS = 25  # rows of the table of the step's other (non-GEMM) kernels; the rest summed in one row
# dspark_backend without batched regions: the same fused GEMMs, each layer's norm/RoPE on its own slice of the
# fused GEMM's output (no [layers, ...] tensors between the GEMM and the per-layer consumers)
UNBATCHED = "dspark_backend, no batched regions"
# dspark_backend with DsparkConfig(colocate_weights=True): each group's weights moved into one allocation when it
# compiles (the context K/V of all layers, each layer's gate/up; a layer's q/k/v keep their own, as its k_proj and
# v_proj are in the larger context group)
COLOCATED = "dspark_backend, colocated weights"
HAND = "hand-stacked torch.compile"  # HandStackedDraft under plain torch.compile
CONTROL = "hand-stacked, second compile"  # the same, compiled again: what two compiles of one model read apart
ROUNDS = {"cuda": 50, "cpu": 10}  # interleaved rounds of every variant's step


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim of `x`, in fp32, the weight applied after the cast back to `x`'s dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """`cos, sin [T, head_dim]` for neox rotate-half RoPE at `positions [T]`."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions[:, None].float() * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` (halves `x1, x2` -> `x1·cos - x2·sin, x2·cos + x1·sin`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def sdpa_heads(x: torch.Tensor, repeats: int = 1) -> torch.Tensor:
    """`[S, heads, D]` -> `[1, heads * repeats, S, D]`, each head repeated `repeats` times (grouped-query K/V)."""
    seq, heads, dim = x.shape
    x = x.transpose(0, 1)[:, None].expand(heads, repeats, seq, dim)
    return x.reshape(1, heads * repeats, seq, dim)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden, q_size, kv_size = cfg.hidden, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(hidden, cfg.eps)
        self.q_proj = nn.Linear(hidden, q_size, bias=False)
        self.k_proj = nn.Linear(hidden, kv_size, bias=False)
        self.v_proj = nn.Linear(hidden, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, hidden, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.eps)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.eps)
        self.mlp = SwiGLU(hidden, cfg.intermediate)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Normed and roped K and raw V of `x [S, hidden]`, each `[S, kv_heads, head_dim]`."""
        shape = (x.shape[0], self.cfg.num_kv_heads, self.cfg.head_dim)
        k = apply_rope(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def attention(self, x, target_hidden, ctx_rope, block_rope) -> torch.Tensor:
        cfg = self.cfg
        q = self.q_proj(x).view(x.shape[0], cfg.num_heads, cfg.head_dim)
        q = apply_rope(self.q_norm(q), *block_rope)
        return self.attend(q, self.key_value(target_hidden, *ctx_rope), self.key_value(x, *block_rope))

    def attend(self, q: torch.Tensor, ctx_kv: tuple, block_kv: tuple) -> torch.Tensor:
        """o_proj of the attention of `q [B, heads, head_dim]` over the context's K/V then the block's (each
        `[S, kv_heads, head_dim]`)."""
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        k = sdpa_heads(torch.cat([ctx_kv[0], block_kv[0]]), groups)
        v = sdpa_heads(torch.cat([ctx_kv[1], block_kv[1]]), groups)
        out = F.scaled_dot_product_attention(sdpa_heads(q), k, v)
        return self.o_proj(out[0].transpose(0, 1).reshape(q.shape[0], -1))

    def forward(self, hidden, target_hidden, ctx_rope, block_rope) -> torch.Tensor:
        hidden = hidden + self.attention(self.input_layernorm(hidden), target_hidden, ctx_rope, block_rope)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)

    def forward(self, block_hidden, target_hidden, block_positions, ctx_positions) -> torch.Tensor:
        """One draft step: `block_hidden [BLOCK, hidden]`, `target_hidden [T, hidden]` -> `[BLOCK, hidden]`."""
        cfg, dtype = self.cfg, block_hidden.dtype
        ctx_rope = rope_cos_sin(ctx_positions, cfg.head_dim, cfg.rope_theta, dtype)
        block_rope = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        hidden = block_hidden
        for layer in self.layers:
            hidden = layer(hidden, target_hidden, ctx_rope, block_rope)
        return self.norm(hidden)


def _stacked_linear(weights: list[torch.Tensor]) -> nn.Linear:
    """A bias-free `nn.Linear` whose weight is `weights` concatenated along their rows (one copy)."""
    weight = torch.cat([w.detach() for w in weights])
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight)
    return linear


class HandStackedDraft(nn.Module):
    """`model`'s draft as a user stacks it by hand for plain torch.compile: per layer one q/k/v weight
    `[q + 2 kv, hidden]` (`qkv_proj`) and one gate/up weight `[2 intermediate, hidden]` (`gate_up_proj`), and the
    context K/V of every layer one `[layers * 2 kv, hidden]` weight (`ctx_kv_proj`) read by one GEMM, its K normed
    and roped for all layers at once. The weights are concatenated once, here; the other modules are `model`'s,
    copied. The same computation as `model`, spelled the way vLLM's and sglang's merged projections are."""

    def __init__(self, model: DraftModel) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.layers = copy.deepcopy(model.layers)
        self.norm = copy.deepcopy(model.norm)
        layers = list(self.layers)
        self.ctx_kv_proj = _stacked_linear([w for layer in layers for w in (layer.k_proj.weight, layer.v_proj.weight)])
        self.ctx_k_norm_weight = nn.Parameter(torch.stack([layer.k_norm.weight.detach() for layer in layers])[:, None])
        for layer in self.layers:
            layer.qkv_proj = _stacked_linear([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
            layer.mlp.gate_up_proj = _stacked_linear([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
            del layer.q_proj, layer.k_proj, layer.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj

    def forward(self, block_hidden, target_hidden, block_positions, ctx_positions) -> torch.Tensor:
        cfg, dtype = self.cfg, block_hidden.dtype
        layers, kv_heads, head_dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        ctx_rope = rope_cos_sin(ctx_positions, head_dim, cfg.rope_theta, dtype)
        block_rope = rope_cos_sin(block_positions, head_dim, cfg.rope_theta, dtype)
        kv = self.ctx_kv_proj(target_hidden).view(-1, layers, 2, kv_heads, head_dim)
        k_ctx = rms_norm(kv[:, :, 0], self.ctx_k_norm_weight, cfg.eps)  # [T, layers, kv_heads, head_dim]
        k_ctx = apply_rope(k_ctx.reshape(-1, layers * kv_heads, head_dim), *ctx_rope).view(k_ctx.shape)
        v_ctx = kv[:, :, 1]
        q_size, kv_size = cfg.num_heads * head_dim, kv_heads * head_dim
        hidden = block_hidden
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv_proj(layer.input_layernorm(hidden)).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rope(layer.q_norm(q.view(-1, cfg.num_heads, head_dim)), *block_rope)
            k = apply_rope(layer.k_norm(k.view(-1, kv_heads, head_dim)), *block_rope)
            hidden = hidden + layer.attend(q, (k_ctx[:, i], v_ctx[:, i]), (k, v.view(-1, kv_heads, head_dim)))
            gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
            hidden = hidden + layer.mlp.down_proj(F.silu(gate) * up)
        return self.norm(hidden)


def build_draft(cfg: DraftConfig, device: str, dtype: torch.dtype, seed: int = 0) -> DraftModel:
    """Random weights; norm weights in [0.5, 1.5), distinct per layer, so a mixed-up layer fails the fp32 parity
    checks (element-wise). In bf16 the step's output hides much of it: the residual stream carries most of the
    output, and two layers' k_norm weights swapped move it by about 1.5 % RMS (measured in fp32 at the Qwen3-8B dims,
    512 tokens), below the bf16 RMS tolerance; `main` prints each variant's error against an fp32 copy of the draft
    beside eager bf16's, where such a mix-up shows as a ratio well above 1."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = DraftModel(cfg)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            nn.init.uniform_(module.weight, 0.5, 1.5)
    return model.to(dtype).eval()


def draft_inputs(cfg: DraftConfig, ctx_len: int, device: str, dtype: torch.dtype, seed: int = 1) -> tuple:
    """`(block_hidden, target_hidden, block_positions, ctx_positions)`: T context tokens, then the block."""
    gen = torch.Generator().manual_seed(seed)
    block_hidden = torch.randn(BLOCK, cfg.hidden, generator=gen)
    target_hidden = torch.randn(ctx_len, cfg.hidden, generator=gen)
    positions = torch.arange(ctx_len + BLOCK)
    args = (block_hidden.to(dtype), target_hidden.to(dtype), positions[ctx_len:], positions[:ctx_len])
    return tuple(a.to(device) for a in args)


def gemm_summary(model: DraftModel, inputs: tuple) -> str:
    """GEMMs of the post-grad graph without and with the dspark pass, traced on a copy of `model` (no Inductor
    codegen), so that the timed compiled models are not recompiled."""
    capture = CaptureBackend()
    with torch.no_grad():
        torch.compile(copy.deepcopy(model), backend=capture)(*inputs)
    before, after = op_counts(capture.before[-1]), op_counts(capture.after[-1])
    plain, fused = (sum(counts[op] for op in GEMM_OPS) for counts in (before, after))
    kinds = Counter(_group_kind(group) for group in capture.reports[-1].groups)
    groups = ", ".join(f"{count} x ({kind})" for kind, count in kinds.items())
    return f"GEMMs per step: plain {plain}, dspark {fused}; {after['dspark.multi_linear']} multi_linear: {groups}"


def _group_kind(group) -> str:
    """`6 k_proj/v_proj on target_hidden`: the size, projections and (if it is an input) activation of a group."""
    projections = sorted({branch.split(".weight")[0].rsplit(".", 1)[-1] for branch in group.branches})
    source = " on target_hidden" if group.activation == "target_hidden" else ""
    return f"{len(group.branches)} {'/'.join(projections)}{source}"


@dataclass
class GemmFamily:
    """The calls of one GEMM shape in a step (`gemm_profile`): `rows x k -> columns` (one entry per weight block)."""

    op: str
    rows: int
    k: int
    columns: tuple[int, ...]
    projections: str  # the model's nn.Linear names with those shapes
    calls: int = 0  # in all profiled calls
    kernels: int = 0  # launched by those calls
    us: float = 0.0  # kernel time (CUDA) or wall time (CPU) of those calls

    def weight_bytes(self, itemsize: int) -> int:
        return sum(self.columns) * self.k * itemsize


def _gemm_shape(event) -> tuple[int, int, tuple[int, ...]]:
    """`(rows, k, columns)` of a profiled GEMM op event (recorded with `record_shapes=True`)."""
    if event.name == "dspark::multi_linear":  # (x [T, K], weights, row_starts, row_counts, biases)
        rows, k = event.input_shapes[0]
        return rows, k, tuple(event.concrete_inputs[3])
    x, weight = event.input_shapes[:2] if event.name == "aten::mm" else event.input_shapes[1:3]
    return x[0], x[1], (weight[1],)


def _subtree(event) -> list:
    return [event, *(e for child in event.cpu_children for e in _subtree(child))]


def _in_gemm(event, gemm_names: set[str]) -> bool:
    """Whether a profiled op event is a GEMM op or runs inside one."""
    while event is not None:
        if event.name in gemm_names:
            return True
        event = event.cpu_parent
    return False


def other_kernels(events, gemm_names: set[str]) -> dict[str, list]:
    """`{kernel name: [launches, µs]}` of the CUDA kernels that the profiled op `events` launched outside the GEMM ops
    (each event's own `kernels`, so a kernel counts once)."""
    others: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.kernels and not _in_gemm(event, gemm_names):
            for kernel in event.kernels:
                others[kernel.name][0] += 1
                others[kernel.name][1] += kernel.duration
    return dict(others)


def gemm_profile(fn, inputs: tuple, model: nn.Module, device: str) -> tuple[list[GemmFamily], int, int, dict]:
    """The GEMM families of `PROFILED_CALLS` calls of `fn(*inputs)` (after 3 warm-up calls), the kernels launched
    per call: all, and the GEMM ops' (0 on CPU), and the other kernels (`other_kernels`, summed over the calls; none
    on CPU). A GEMM op inside another (the aten::mm calls of a multi_linear) counts as part of the outer one."""
    from torch.profiler import ProfilerActivity, profile

    names = defaultdict(set)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            names[(module.in_features, module.out_features)].add(name.rsplit(".", 1)[-1])
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(PROFILED_CALLS):
                fn(*inputs)
            if device == "cuda":
                torch.cuda.synchronize()
    gemm_names = {op.replace(".", "::") for op in GEMM_OPS}  # as the profiler names them
    families: dict[tuple, GemmFamily] = {}
    all_kernels = gemm_kernels = 0
    events = prof.events()
    for event in events:
        all_kernels += len(event.kernels)
        if event.name not in gemm_names or _in_gemm(event.cpu_parent, gemm_names):
            continue
        rows, k, columns = _gemm_shape(event)
        projections = "/".join(sorted({n for c in columns for n in names.get((k, c), {"?"})}))
        family = families.setdefault(
            (event.name, rows, k, columns), GemmFamily(event.name, rows, k, columns, projections)
        )
        kernels = [kernel for e in _subtree(event) for kernel in e.kernels]
        family.calls += 1
        family.kernels += len(kernels)
        family.us += sum(kernel.duration for kernel in kernels) if device == "cuda" else event.cpu_time_total
        gemm_kernels += len(kernels)
    others = other_kernels(events, gemm_names)
    return list(families.values()), all_kernels // PROFILED_CALLS, gemm_kernels // PROFILED_CALLS, others


def gemm_table(name: str, ctx_len: int, profiled: tuple, bandwidth: float, itemsize: int, device: str) -> list[str]:
    """Markdown lines of one `gemm_profile`: one row per GEMM family, then the launches per step, then (CUDA) the
    other kernels, the `OTHER_KERNEL_ROWS` longest per step and one row for the rest."""
    families, kernels, gemm_kernels, others = profiled
    time_kind = "kernel µs" if device == "cuda" else "wall µs"
    lines = [
        f"{name}, T = {ctx_len}: the step's GEMMs",
        "",
        f"| GEMM (rows x K -> columns) | nn.Linear | op | per step | kernels per call | {time_kind} per call | "
        "MB | % of copy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    total_us = 0.0
    for f in sorted(families, key=lambda f: -f.us):
        per_call = f.us / f.calls
        total_us += f.us / PROFILED_CALLS
        if len(f.columns) == 1 or len(set(f.columns)) > 1:
            columns = "+".join(map(str, f.columns))
        else:
            columns = f"{len(f.columns)} x {f.columns[0]}"
        copy_us = 1e6 * f.weight_bytes(itemsize) / bandwidth
        lines.append(
            f"| {f.rows} x {f.k} -> {columns} | {f.projections} | {f.op} | {f.calls // PROFILED_CALLS} | "
            f"{f'{f.kernels / f.calls:.1f}' if device == 'cuda' else '-'} | {per_call:.1f} | "
            f"{f.weight_bytes(itemsize) / 1e6:.1f} | "
            f"{100 * copy_us / per_call:.0f} % |"
        )
    launches = (
        f"; kernels launched per step: {kernels}, {gemm_kernels} of them by the GEMMs" if device == "cuda" else ""
    )
    lines += ["", f"GEMM time per step: {total_us:.1f} µs{launches}.", ""]
    if others:
        other_us = sum(us for _, us in others.values()) / PROFILED_CALLS
        lines += [
            f"{name}, T = {ctx_len}: the other kernels, {other_us:.1f} µs per step (kernel time)",
            "",
            "| kernel | launches per step | kernel µs per step |",
            "|---|---|---|",
        ]
        ranked = sorted(others.items(), key=lambda item: -item[1][1])
        for kernel, (launches, us) in ranked[:OTHER_KERNEL_ROWS]:
            lines.append(
                f"| `{short_kernel_name(kernel)}` | {launches / PROFILED_CALLS:g} | {us / PROFILED_CALLS:.1f} |"
            )
        rest = ranked[OTHER_KERNEL_ROWS:]
        if rest:
            launches = sum(n for _, (n, _) in rest) / PROFILED_CALLS
            us = sum(t for _, (_, t) in rest) / PROFILED_CALLS
            lines.append(f"| the other {len(rest)} kernels | {launches:g} | {us:.1f} |")
        lines.append("")
    return lines


def short_kernel_name(name: str, width: int = 80) -> str:
    """`name` cut to `width` characters around an ellipsis, keeping its end (Triton's kernels of one fusion differ
    only in their last characters, the kernel index)."""
    tail = 18
    return name if len(name) <= width else f"{name[: width - tail - 3]}...{name[-tail:]}"


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def assert_parity(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str:
    """fp32: element-wise `assert_close_for_dtype`. bf16: the relative RMS error within the bf16 tolerance (2e-2).
    Element-wise, 2e-2 is too tight for a whole bf16 model: Inductor vs eager on this draft differ by ~0.7% RMS,
    and a few of the 65k outputs by more than 2e-2 (measured on CPU, 5 layers, 3 seeds)."""
    error = relative_rms_error(actual, expected)
    if dtype == torch.float32:
        assert_close_for_dtype(actual, expected, dtype)
    else:
        assert error <= TOLERANCES[dtype], f"relative RMS error {error:.2e} exceeds {TOLERANCES[dtype]:.0e}"
    return f"relative RMS error {error:.1e}, max abs error {(actual - expected).abs().max():.1e}"


def step_gemm_work(model: DraftModel, ctx_len: int) -> list[tuple[int, int]]:
    """`(weight bytes, FLOPs)` of each nn.Linear of `model` in one step at context `ctx_len`: its weight read once,
    its FLOPs over every row it multiplies (k_proj and v_proj: the context's and the block's, the others: the
    block's)."""
    work = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            rows = BLOCK + (ctx_len if name.rsplit(".", 1)[-1] in ("k_proj", "v_proj") else 0)
            weight = module.weight
            work.append((weight.numel() * weight.element_size(), 2 * rows * module.in_features * module.out_features))
    return work


def gemm_bounds(work: list[tuple[int, int]], bandwidth: float, gemm_rate: float) -> tuple[float, float]:
    """`(floor, roofline)` in µs of the GEMMs of `step_gemm_work`: the floor max(all weight bytes ÷ the copy rate,
    all FLOPs ÷ the GEMM rate), which no way of running them beats; the roofline the sum over the GEMMs of each
    one's max(bytes ÷ copy rate, FLOPs ÷ GEMM rate), what they take one after another, each at its own bound."""
    weight_bytes, flops = (sum(column) for column in zip(*work, strict=True))
    floor = 1e6 * max(weight_bytes / bandwidth, flops / gemm_rate)
    roofline = 1e6 * sum(max(b / bandwidth, f / gemm_rate) for b, f in work)
    return floor, roofline


def speedup_bound(
    ctx_len: int,
    compile_us: float,
    roofline_us: float,
    other_us: float,
    gemm_bytes: float,
    bandwidth: float,
    gemm_times: dict[str, float],
) -> str:
    """What `TARGET_SPEEDUP` over torch.compile asks of dspark_backend's step at `ctx_len`: the time it leaves the
    step's GEMMs after dspark_backend's other kernels as profiled (`gemm_profile`), as an average rate over the
    `gemm_bytes` of weights they read per step (the K/V weights twice: for the context and for the block), against
    the fastest of `gemm_times` (µs per step of the same GEMMs as each compiled variant ran them, and
    `gemm_read_us`'s kernel that only reads their weights; every way measured in the run counts, so a reader slower
    than cuBLAS bounds nothing) and their roofline (`gemm_bounds`); all in µs per step."""
    target = compile_us / TARGET_SPEEDUP
    left = target - other_us

    def rate(us: float) -> str:
        return f"{gemm_bytes / us / 1e6:.2f} TB/s, {100 * gemm_bytes / us / 1e-6 / bandwidth:.0f} % of the copy rate"

    ranked = sorted(gemm_times.items(), key=lambda item: item[1])
    (fastest, fastest_us), rest = ranked[0], ranked[1:]
    verdict = "above" if fastest_us > left else "within"
    asks = f"{left:.1f} ({rate(left)})" if left > 0 else f"{left:.1f}, less than nothing"
    others = "; ".join(f"{name} {us:.1f}" for name, us in rest)
    return (
        f"Context {ctx_len}: {TARGET_SPEEDUP}x faster than torch.compile is {target:.1f} µs per step. dspark_backend's "
        f"other kernels as profiled take {other_us:.1f} (the gaps between launches not counted), which leaves its "
        f"GEMMs at most {asks} for the {gemm_bytes / 1e6:.1f} MB of weights they read per step. The fastest of them "
        f"as measured: {fastest} {fastest_us:.1f} "
        f"({rate(fastest_us)}), {verdict} that" + (f" (then {others})" if others else "") + "; at their roofline "
        f"with each weight read once ({roofline_us:.1f}; the GEMMs as run read the K/V weights twice) the step would "
        f"take {roofline_us + other_us:.1f}."
    )


def gemm_read_us(families: list[GemmFamily], itemsize: int, reads: dict[int, float]) -> float:
    """µs per step that the fastest of `_read_floor`'s read kernels takes to read the weights of every GEMM call of
    `families` once, back to back (`back_to_back_read_us`; CUDA only); `reads` caches the time per byte count."""
    total = 0.0
    for family in families:
        n_bytes = family.weight_bytes(itemsize)
        if n_bytes not in reads:
            from _read_floor import back_to_back_read_us, read_sources

            reads[n_bytes] = back_to_back_read_us(read_sources(n_bytes))
        total += reads[n_bytes] * family.calls / PROFILED_CALLS
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny dims (hidden 64, 3 layers) for a quick check")
    parser.add_argument(
        "--hidden",
        type=int,
        help="--small's layout at this hidden size (4 heads of hidden / 4, 2 K/V heads, intermediate 2 x hidden)",
    )
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    device, cfg = args.device, SMALL if args.small else QWEN3_8B
    if args.hidden:
        cfg = dataclasses.replace(SMALL, hidden=args.hidden, head_dim=args.hidden // 4, intermediate=2 * args.hidden)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bandwidth, rate = copy_bandwidth(device), gemm_rate(device, dtype)
    eager = build_draft(cfg, device, dtype)
    inputs = {ctx_len: draft_inputs(cfg, ctx_len, device, dtype) for ctx_len in CONTEXTS}
    for _, target_hidden, _, ctx_positions in inputs.values():
        torch._dynamo.maybe_mark_dynamic(target_hidden, 0)
        torch._dynamo.maybe_mark_dynamic(ctx_positions, 0)
    gemms = gemm_summary(eager, inputs[CONTEXTS[0]])
    print(gemms, flush=True)
    variants = {
        "eager": eager,
        "torch.compile": torch.compile(copy.deepcopy(eager)),
        "dspark_backend": torch.compile(copy.deepcopy(eager), backend=dspark_fx.dspark_backend),
        UNBATCHED: torch.compile(copy.deepcopy(eager), backend=dspark_fx.make_backend({"batch_regions": False})),
        COLOCATED: torch.compile(copy.deepcopy(eager), backend=dspark_fx.make_backend({"colocate_weights": True})),
        HAND: torch.compile(HandStackedDraft(eager)),
        CONTROL: torch.compile(HandStackedDraft(eager)),
    }
    compiled = [name for name in variants if name != "eager"]
    profiled_variants = [name for name in compiled if name != CONTROL]
    weight_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
    rows, gemm_lines, bound_lines, reads = [], [], [], {}
    reference32 = copy.deepcopy(eager).float() if dtype != torch.float32 else eager
    with torch.no_grad():
        for ctx_len, step_inputs in inputs.items():
            expected = eager(*step_inputs)
            expected32 = reference32(*(t.float() if t.is_floating_point() else t for t in step_inputs))
            eager_error = relative_rms_error(expected, expected32)
            for name in compiled:
                start = time.perf_counter()
                with compile_counts() as counts:
                    out = variants[name](*step_inputs)
                seconds = time.perf_counter() - start
                parity = assert_parity(out, expected, dtype)
                if dtype != torch.float32:
                    error = relative_rms_error(out, expected32)
                    parity += (
                        f"; against an fp32 copy {error:.1e}, eager's {eager_error:.1e} ({error / eager_error:.2f}x)"
                    )
                print(f"T={ctx_len} {name}: first call {seconds:.1f} s, {counts['frames']} graph(s) compiled; {parity}")
            steps = []
            for model in variants.values():
                if device == "cuda":  # the replay timed computes the step: checked against eager as the first call
                    steps.append(graphed(model, step_inputs, partial(assert_parity, expected=expected, dtype=dtype)))
                else:
                    steps.append(partial(model, *step_inputs))
            times = dict(zip(variants, interleaved_median_us(steps, device, ROUNDS[device]), strict=True))
            print(f"T={ctx_len} µs:", {k: round(v, 1) for k, v in times.items()}, flush=True)
            floor_us, roofline_us = gemm_bounds(step_gemm_work(eager, ctx_len), bandwidth, rate)
            gemm_times = {}
            for name in profiled_variants:
                profiled = gemm_profile(variants[name], step_inputs, variants[name]._orig_mod, device)
                table = gemm_table(name, ctx_len, profiled, bandwidth, dtype.itemsize, device)
                gemm_lines += table
                print("\n".join(table), flush=True)
                families, _, _, others = profiled
                gemm_times[f"{name}'s GEMM kernels"] = sum(f.us for f in families) / PROFILED_CALLS
                if name == "dspark_backend" and device == "cuda":
                    other_us = sum(us for _, us in others.values()) / PROFILED_CALLS
                    gemm_times[READ] = gemm_read_us(families, dtype.itemsize, reads)
                    gemm_bytes = sum(f.weight_bytes(dtype.itemsize) * f.calls for f in families) / PROFILED_CALLS
            if device == "cuda":
                bound_lines.append(
                    speedup_bound(
                        ctx_len, times["torch.compile"], roofline_us, other_us, gemm_bytes, bandwidth, gemm_times
                    )
                )
                print(bound_lines[-1], flush=True)
            rows.append((ctx_len, floor_us, roofline_us, times))
    where = f"GPU {torch.cuda.get_device_name()}" if device == "cuda" else f"CPU {platform.machine()}"
    timing = "CUDA-graph replay" if device == "cuda" else "wall clock, no CUDA graph"
    lines = [
        f"{where}, torch {torch.__version__}; measured copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
        f"GEMM rate {rate / 1e12:.3g} TFLOP/s; µs per draft step, {timing} (time ÷ torch.compile, time ÷ floor)",
        "",
        f"Draft: {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.num_heads}/{cfg.num_kv_heads} heads x "
        f"{cfg.head_dim}, intermediate {cfg.intermediate}, block {BLOCK}, {str(dtype).removeprefix('torch.')}; "
        f"weights {weight_bytes / 1e6:.1f} MB. Floor: the GEMMs' weights read once at the copy rate or their FLOPs at "
        "the GEMM rate, the larger; roofline: each GEMM at the larger of the two, one after another (`gemm_bounds`). "
        f"{gemms}.",
        "",
        "| T | floor µs | roofline µs | "
        + " | ".join(variants)
        + " | dspark_backend ÷ hand-stacked | control: second compile ÷ hand-stacked |",
        "|" + "---|" * (len(variants) + 5),
    ]
    for ctx_len, floor_us, roofline_us, times in rows:
        cells = [f"{t:.1f} ({t / times['torch.compile']:.2f}x, {t / floor_us:.2f}x)" for t in times.values()]
        cells.append(f"{times['dspark_backend'] / times[HAND]:.2f}x")
        cells.append(f"{times[CONTROL] / times[HAND]:.3f}x")
        lines.append(f"| {ctx_len} | {floor_us:.1f} | {roofline_us:.1f} | " + " | ".join(cells) + " |")
    bounds = ["", *bound_lines] if bound_lines else []
    table = "\n".join([*lines, *bounds, "", *gemm_lines])
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
