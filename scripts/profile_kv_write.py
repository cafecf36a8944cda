"""Call `dspark::multi_linear_kv_write` on a draft config a few times: the workload for a kernel profiler.

    ncu --cache-control none --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --launch-skip 3 \\
        python3 scripts/profile_kv_write.py --config qwen3-8b --tokens 64

The op gets what `dspark_backend` hands it for the config's draft (benchmarks/dspark_write.py's configs: 5 layers,
separate K and V weights per layer, a bf16 k_norm weight, one fp32 [4096, head_dim] RoPE table, neox, distinct
random slots of 8192, random positions), so the kernels launched are the lowered write's at that T: the fused kernel
up to 16 tokens, else the GEMM path (pointer table, batched GEMM, heads kernel). `--device cpu --config tiny` runs
the op's CPU reference (a check of the script itself).
"""

from __future__ import annotations

import argparse

import torch

import custom_ops  # noqa: F401  (registers the dspark ops)

CONFIGS = {  # hidden, K/V heads, head_dim
    "qwen3-8b": (4096, 8, 128),
    "qwen3-4b": (2560, 8, 128),
    "hd64": (7168, 16, 64),
    "tiny": (64, 2, 16),
}
LAYERS, SLOTS, POSITIONS = 5, 8192, 4096


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=CONFIGS, default="qwen3-8b")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=6, help="calls of the op (a profiler can skip the first ones)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    hidden, heads, head_dim = CONFIGS[args.config]
    if not 0 < args.tokens <= SLOTS:
        parser.error(f"--tokens must be in [1, {SLOTS}]")
    dev, dtype, gen = args.device, torch.bfloat16, torch.Generator().manual_seed(0)
    kv = heads * head_dim

    def weight() -> torch.Tensor:
        return (torch.randn(kv, hidden, generator=gen) * hidden**-0.5).to(dtype).to(dev)

    k_weights, v_weights = [weight() for _ in range(LAYERS)], [weight() for _ in range(LAYERS)]
    norms = [(torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(dev) for _ in range(LAYERS)]
    table = torch.randn(POSITIONS, head_dim, generator=gen).to(dev)
    x = torch.randn(args.tokens, hidden, generator=gen).to(dtype).to(dev)
    positions = torch.randint(0, POSITIONS, (args.tokens,), generator=gen).to(dev)
    cache_loc = torch.randperm(SLOTS, generator=gen)[: args.tokens].to(dev)
    k_caches, v_caches = (
        [torch.zeros(SLOTS, heads, head_dim, dtype=dtype, device=dev) for _ in range(LAYERS)] for _ in range(2)
    )
    none, starts = [None] * LAYERS, [0] * LAYERS
    for _ in range(args.calls):
        torch.ops.dspark.multi_linear_kv_write(
            x, k_weights, starts, none, v_weights, starts, none, norms, [1e-6] * LAYERS, [table] * LAYERS, positions,
            True, k_caches, v_caches, cache_loc, None, heads, head_dim,
        )  # fmt: skip
    if dev == "cuda":
        torch.cuda.synchronize()
    written = sum(int(torch.count_nonzero(c)) for c in k_caches + v_caches)
    print(f"{args.calls} calls of the {args.config} write at T = {args.tokens} on {dev}: {written} values written")


if __name__ == "__main__":
    main()
