"""Probe, not in the op: from 64 tokens the K/V write is a batched GEMM then the heads kernel (norm, RoPE, writes).
Does running the layers in two groups on two streams, so that one group's heads kernel runs beside the other
group's GEMM (and fills the SMs a GEMM's last wave leaves idle), make the write faster?

Each variant is `dspark::multi_linear_kv_write` over Qwen3-8B draft dims (5 layers, K/V rows sliced out of a fused
q/k/v weight, neox halves table, RMSNorm), captured in a CUDA graph, timed interleaved after an L2 flush (median):
`all` one call over the five layers; `seq A|B` the groups one after the other on one stream; `fork A|B` group A on
the capturing stream and group B on a second stream forked from it and joined back; `one GEMM` cuBLAS on the
concatenated K/V weight alone (no norm, RoPE or write). Every variant's caches are compared with `all`'s.

    python benchmarks/experimental/split_streams_probe.py   # GPU only"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import graphed, interleaved_median_us

import custom_ops  # noqa: F401  (registers torch.ops.dspark)

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SLOTS, POSITIONS = 5, 4096, 32, 8, 128, 8192, 4096
KV = KV_HEADS * HEAD_DIM


def make_layers(device: str) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    qkv = [
        (torch.randn(HEADS * HEAD_DIM + 2 * KV, HIDDEN, generator=gen) * 0.02).to(device, torch.bfloat16)
        for _ in range(LAYERS)
    ]
    norms = [(1 + 0.1 * torch.randn(HEAD_DIM, generator=gen)).to(device, torch.bfloat16) for _ in range(LAYERS)]
    inv = 1e6 ** (-torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.arange(POSITIONS, dtype=torch.float64)[:, None] * inv[None]
    table = torch.cat([angles.cos(), angles.sin()], dim=1).float().to(device)
    caches = [
        (
            torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
            torch.zeros(SLOTS, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16),
        )
        for _ in range(LAYERS)
    ]
    return {"qkv": qkv, "norms": norms, "table": table, "caches": caches}


def write(layers: dict, group: range, x, positions, loc) -> None:
    q = HEADS * HEAD_DIM
    torch.ops.dspark.multi_linear_kv_write(
        x,
        [layers["qkv"][i] for i in group],
        [q] * len(group),
        [None] * len(group),
        [layers["qkv"][i] for i in group],
        [q + KV] * len(group),
        [None] * len(group),
        [layers["norms"][i] for i in group],
        [1e-6] * len(group),
        [layers["table"]] * len(group),
        positions,
        True,
        [layers["caches"][i][0] for i in group],
        [layers["caches"][i][1] for i in group],
        loc,
        None,
        KV_HEADS,
        HEAD_DIM,
    )


def variants(layers: dict, side: torch.cuda.Stream) -> dict:
    out = {"all": lambda *a: write(layers, range(LAYERS), *a)}
    for split in (2, 3):
        a, b = range(split), range(split, LAYERS)

        def seq(*args, a=a, b=b):
            write(layers, a, *args)
            write(layers, b, *args)

        def fork(*args, a=a, b=b):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                write(layers, b, *args)
            write(layers, a, *args)
            main.wait_stream(side)

        out[f"seq {split}|{LAYERS - split}"] = seq
        out[f"fork {split}|{LAYERS - split}"] = fork
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 200, 512, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    device = "cuda"
    layers = make_layers(device)
    side = torch.cuda.Stream(priority=-1)
    wcat = torch.cat([w[HEADS * HEAD_DIM :] for w in layers["qkv"]])
    names = [*list(variants(layers, side)), "one GEMM"]
    print("| T | " + " | ".join(names) + " | max |cache - all's| |")
    print("|---:|" + "---:|" * len(names) + "---:|")
    for tokens in args.tokens:
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, HIDDEN, generator=gen).to(device, torch.bfloat16)
        positions = torch.randint(0, POSITIONS, (tokens,), generator=gen).to(device)
        loc = torch.randperm(SLOTS, generator=gen)[:tokens].to(device)
        fns = variants(layers, side)
        expected, errors = None, []
        for _name, fn in fns.items():
            for k, v in layers["caches"]:
                k.fill_(float("nan"))
                v.fill_(float("nan"))
            fn(x, positions, loc)
            torch.cuda.synchronize()
            written = [c[loc].float() for pair in layers["caches"] for c in pair]
            if expected is None:
                expected = written
            errors.append(
                torch.stack([(w - e).abs().max() for w, e in zip(written, expected, strict=True)]).max().item()
            )
        calls = [graphed(fn, (x, positions, loc)) for fn in fns.values()]
        calls.append(graphed(lambda x: x @ wcat.T, (x,)))
        times = interleaved_median_us(calls, device, args.rounds)
        print(f"| {tokens} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {max(errors):.3g} |")


if __name__ == "__main__":
    main()
