"""A model of lone linears (a two-linear MLP, no two GEMMs on one activation) under `dspark_backend` and plain
`torch.compile`, timed interleaved in one run: the pass must never make it slower.

    python3 benchmarks/lone_linears.py                    # CUDA when there is one (bf16, CUDA graphs), else CPU
    python3 benchmarks/lone_linears.py --device cpu       # fp32, wall clock per call

Columns: torch.compile; dspark_backend as it routes lone GEMMs on this device (`skinny_linears=True`, the default);
dspark_backend with `skinny_linears=False`; and their ratios to torch.compile. On CUDA each call is a CUDA-graph
replay; on CPU a plain call (`--rounds` interleaved rounds, the median).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
from _timing import graphed, interleaved_median_us
from torch import nn

import dspark_fx
from dspark_fx.testing import assert_close_for_dtype


class MLP(nn.Module):
    """Two linears with a GELU between (256 -> 512 -> 256 by default): each GEMM alone on its activation."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner)
        self.down = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


VARIANTS = {
    "torch.compile": "inductor",
    "dspark_backend": dspark_fx.make_backend(),
    "dspark_backend, skinny_linears=False": dspark_fx.make_backend({"skinny_linears": False}),
}


def time_tokens(model: MLP, tokens: int, device: str, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """µs per call of every variant at `tokens` rows (after checking each against eager)."""
    x = torch.randn(tokens, model.up.in_features, device=device, dtype=dtype)
    with torch.no_grad():
        want = model(x)
        calls = []
        for backend in VARIANTS.values():
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            check = partial(assert_close_for_dtype, expected=want, dtype=dtype)
            check(compiled(x))
            calls.append(graphed(compiled, (x,), check) if device == "cuda" else (lambda c=compiled: c(x)))
        times = interleaved_median_us(calls, device, rounds)
    return dict(zip(VARIANTS, times, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inner", type=int, default=512)
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 200 on CUDA, 100 on CPU)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--small", action="store_true", help="smoke run: a 32 -> 64 -> 32 MLP, 5 rounds")
    args = parser.parse_args()
    if args.small:
        args.hidden, args.inner, args.rounds = 32, 64, 5
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rounds = args.rounds or (200 if cuda else 100)
    torch.manual_seed(0)
    model = MLP(args.hidden, args.inner).to(args.device, dtype).requires_grad_(False)
    names = list(VARIANTS)
    lines = [
        f"Lone linears: MLP {args.hidden} -> {args.inner} -> {args.hidden}, {args.device}, {dtype}, torch "
        f"{torch.__version__}, {'CUDA-graph replay' if cuda else 'wall clock'}, median of {rounds} interleaved rounds",
        "",
        "| T | " + " | ".join([*(f"{n} µs" for n in names), *(f"{n} ÷ torch.compile" for n in names[1:])]) + " |",
        "|---|" + "---:|" * (2 * len(names) - 1),
    ]
    print("\n".join(lines), flush=True)
    for tokens in args.tokens:
        times = time_tokens(model, tokens, args.device, dtype, rounds)
        base = times[names[0]]
        cells = [f"{times[n]:.1f}" for n in names] + [f"{times[n] / base:.2f}x" for n in names[1:]]
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
