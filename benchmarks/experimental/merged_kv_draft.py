"""Probe, not a pass: does reading each layer's K/V weights once per draft step pay?

The draft of `benchmarks/draft_step.py` applies every layer's `k_proj`/`v_proj` twice per step: to the context
(`target_hidden`, all layers fused by dspark_backend into one GEMM) and to the block's hidden state. The step's floor
counts each weight once. `MergedKVDraft` is the same draft written so that each layer projects
`cat([target_hidden, x])` once with its K/V weights (and, with `with_q`, with its Q weight too, the context rows of Q
computed and dropped), then norms and ropes the context rows and the block rows apart. It is timed against the draft
as written, under torch.compile and dspark_backend, with the hand-stacked baseline, all in one interleaved run
(CUDA-graph replay, L2 flushed before each call), at context 16 and 512.

    python benchmarks/experimental/merged_kv_draft.py              # GPU: Qwen3-8B draft dims, bf16
    python benchmarks/experimental/merged_kv_draft.py --device cpu  # CPU: tiny dims, fp32, parity and wall clock
"""

from __future__ import annotations

import argparse
import copy
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import draft_step
from _timing import graphed, interleaved_median_us

import dspark_fx


class MergedKVDraft(nn.Module):
    """`model`'s draft (copied) with each layer's K/V weights applied once to the context and block rows together."""

    def __init__(self, model: draft_step.DraftModel, with_q: bool) -> None:
        super().__init__()
        self.model = copy.deepcopy(model)
        self.with_q = with_q

    def forward(self, block_hidden, target_hidden, block_positions, ctx_positions) -> torch.Tensor:
        cfg, dtype = self.model.cfg, block_hidden.dtype
        ctx_rope = draft_step.rope_cos_sin(ctx_positions, cfg.head_dim, cfg.rope_theta, dtype)
        block_rope = draft_step.rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        ctx_len, hidden = target_hidden.shape[0], block_hidden
        for layer in self.model.layers:
            x = layer.input_layernorm(hidden)
            rows = torch.cat([target_hidden, x])
            q = layer.q_proj(rows)[ctx_len:] if self.with_q else layer.q_proj(x)
            q = draft_step.apply_rope(layer.q_norm(q.view(x.shape[0], cfg.num_heads, cfg.head_dim)), *block_rope)
            shape = (rows.shape[0], cfg.num_kv_heads, cfg.head_dim)
            k, v = layer.k_norm(layer.k_proj(rows).view(shape)), layer.v_proj(rows).view(shape)
            ctx_kv = (draft_step.apply_rope(k[:ctx_len], *ctx_rope), v[:ctx_len])
            block_kv = (draft_step.apply_rope(k[ctx_len:], *block_rope), v[ctx_len:])
            hidden = hidden + layer.attend(q, ctx_kv, block_kv)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.norm(hidden)


def variants(eager: draft_step.DraftModel, device: str) -> dict[str, nn.Module]:
    backend = dspark_fx.dspark_backend if device == "cuda" else dspark_fx.make_backend({"fuse_on_cpu": True})
    return {
        "torch.compile": torch.compile(copy.deepcopy(eager)),
        "dspark_backend": torch.compile(copy.deepcopy(eager), backend=backend),
        "hand-stacked torch.compile": torch.compile(draft_step.HandStackedDraft(eager)),
        "K/V merged, torch.compile": torch.compile(MergedKVDraft(eager, with_q=False)),
        "K/V merged, dspark_backend": torch.compile(MergedKVDraft(eager, with_q=False), backend=backend),
        "Q/K/V merged, dspark_backend": torch.compile(MergedKVDraft(eager, with_q=True), backend=backend),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved timing rounds (a cell is the median)")
    args = parser.parse_args()
    device = args.device
    cfg, dtype = (draft_step.QWEN3_8B, torch.bfloat16) if device == "cuda" else (draft_step.SMALL, torch.float32)
    eager = draft_step.build_draft(cfg, device, dtype)
    models = variants(eager, device)
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}", flush=True)
    with torch.no_grad():
        for ctx_len in draft_step.CONTEXTS:
            inputs = draft_step.draft_inputs(cfg, ctx_len, device, dtype)
            torch._dynamo.maybe_mark_dynamic(inputs[1], 0)
            torch._dynamo.maybe_mark_dynamic(inputs[3], 0)
            expected = eager(*inputs)
            calls = []
            for name, model in models.items():
                print(f"context {ctx_len}, {name}: {draft_step.assert_parity(model(*inputs), expected, dtype)}")
                calls.append(graphed(model, inputs) if device == "cuda" else partial(model, *inputs))
            times = interleaved_median_us(calls, device, args.rounds)
            for name, us in zip(models, times, strict=True):
                print(f"| {ctx_len} | {name} | {us:.1f} | {us / times[0]:.3f}x |", flush=True)


if __name__ == "__main__":
    main()
