"""Draft context-KV write on the GPU: eager per-layer vs hand-stacked vs torch.compile vs dspark_backend.

Qwen3-8B DSpark draft dims (N=5, hidden 4096, 32/8 heads, head_dim 128, bf16), T in {8, 64, 512, 4096}.
Every variant is timed as called (eager launches) and captured in a manual `torch.cuda.CUDAGraph` (how engines
run it); the floor is max(weight bytes / measured copy bandwidth, GEMM FLOPs / measured bf16 GEMM rate).
Times are medians of `triton.testing.do_bench`; ratios are against eager per-layer in the same run.

    python benchmarks/dspark_write.py --out BENCH.md
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from _timing import graphed
from triton.testing import do_bench

import dspark_fx
from dspark_fx.reference_draft import DraftKVConfig, DraftKVWriter, apply_rope

CFG = DraftKVConfig(num_layers=5, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, num_slots=8192)
TOKENS = (8, 64, 512, 4096)


class HandStacked(torch.nn.Module):
    """sglang-style stacked path: weights concatenated once (a copy), one GEMM, one norm, one RoPE, L writes."""

    def __init__(self, model: DraftKVWriter) -> None:
        super().__init__()
        cfg = model.cfg
        rows = slice(cfg.q_size, cfg.q_size + 2 * cfg.kv_size)
        self.model = model
        self.w_all = torch.cat([layer.qkv_proj.weight[rows] for layer in model.layers]).detach().clone()
        self.norm_w = torch.stack([layer.k_norm_weight.float() for layer in model.layers]).detach()

    def forward(self, ctx, positions, cache_loc):
        cfg, n = self.model.cfg, len(self.model.layers)
        kv = (ctx @ self.w_all.T).view(-1, n, 2, cfg.num_kv_heads, cfg.head_dim)
        k = kv[:, :, 0].float()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + self.model.layers[0].eps) * self.norm_w[None, :, None]
        k = apply_rope(k.to(ctx.dtype).flatten(1, 2), self.model.cos_sin_0[positions], cfg.rope_style)
        k = k.view(-1, n, cfg.num_kv_heads, cfg.head_dim)
        for i, (k_cache, v_cache) in enumerate(self.model.caches()):
            k_cache[cache_loc] = k[:, i]
            v_cache[cache_loc] = kv[:, i, 1]


def measure_ceilings() -> tuple[float, float]:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (copy_ms * 1e-3), 2 * 8192**3 / (gemm_ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth, gemm_rate = measure_ceilings()
    base = DraftKVWriter(CFG, "cuda")
    variants = {
        "eager per-layer": base,
        "hand-stacked eager": HandStacked(copy.deepcopy(base)),
        "torch.compile": torch.compile(copy.deepcopy(base)),
        "dspark_backend": torch.compile(copy.deepcopy(base), backend=dspark_fx.dspark_backend),
    }
    weight_bytes = CFG.num_layers * 2 * CFG.kv_size * CFG.hidden * 2
    rows = []
    with torch.no_grad():
        for tokens in TOKENS:
            ctx = torch.randn(tokens, CFG.hidden, device="cuda", dtype=CFG.dtype)
            positions = torch.randint(0, CFG.max_position, (tokens,), device="cuda")
            loc = torch.randperm(CFG.num_slots, device="cuda")[:tokens]
            inputs = (ctx, positions, loc)
            gemm_flops = 2 * tokens * weight_bytes // 2  # 2 FLOPs per bf16 weight element per token
            floor_us = 1e6 * max(weight_bytes / bandwidth, gemm_flops / gemm_rate)
            times = {}
            for name, fn in variants.items():
                times[name] = 1e3 * do_bench(
                    lambda fn=fn, inputs=inputs: fn(*inputs), warmup=25, rep=100, return_mode="median"
                )
                replay = graphed(fn, inputs)
                times[name + " (graph)"] = 1e3 * do_bench(replay, warmup=25, rep=100, return_mode="median")
            rows.append((tokens, floor_us, times))
            print(tokens, {k: round(v, 1) for k, v in times.items()}, flush=True)
    names = list(rows[0][2])
    header = "| T | floor µs | " + " | ".join(names) + " |"
    lines = [
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; measured copy bandwidth "
        f"{bandwidth / 1e12:.2f} TB/s, bf16 GEMM {gemm_rate / 1e12:.0f} TFLOP/s; µs (ratio vs eager per-layer)",
        "",
        header,
        "|" + "---|" * (len(names) + 2),
    ]
    for tokens, floor_us, times in rows:
        ref = times["eager per-layer"]
        cells = [f"{times[n]:.1f} ({ref / times[n]:.2f}x)" for n in names]
        lines.append(f"| {tokens} | {floor_us:.1f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
