"""Call every dspark CUDA kernel at small and edge sizes: the workload `compute-sanitizer` checks.

`bash scripts/gpu_check.sh sanitize` runs this script under memcheck, racecheck, initcheck and synccheck (with
`PYTORCH_NO_CUDA_MEMORY_CACHING=1`, so every tensor is its own allocation and an out-of-bounds access cannot
hide inside a cached block). The calls cover empty and single-row batches, odd sizes, strided inputs, negative
and out-of-range slots, positions and request ids (which the kernels must skip), and every DSV4 compressor path
(c4 / c128 / online c128, ring and paged addressing, prefill, extend, decode, the FlashMLA / FP8 / FP4 stores),
and both paths of the multi-layer K/V write. `--only GROUP` makes one group of calls; `--only benchmark_dims`,
the only way to make that group, makes the K/V write at the write benchmark's dims (`write_at_benchmark_dims`).
The script reads no results back: on the H200, initcheck reports PyTorch's own elementwise kernels reading
outputs of cuBLAS (a plain `torch.mm` shows it too), so the driver leaves every check to the sanitizer. For the same
reason initcheck reports the heads kernels of the K/V write's GEMM path reading the projections that a cuBLAS GEMM
wrote: `gpu_check.sh sanitize` counts those reports apart from any other and runs the `torch.mm` control.
`--device cpu` makes the same calls without the out-of-range values (the CPU path raises for those, by contract):
a quick check of the driver itself (tests/test_sanitize_driver.py).

    compute-sanitizer --tool memcheck python3 scripts/sanitize_driver.py
"""

from __future__ import annotations

import argparse

import torch

import custom_ops
from custom_ops import _build
from custom_ops.dsv4.compressor import DSV4Compressor, PagedAddressing
from custom_ops.dsv4.store import cache_page_bytes
from custom_ops.layouts.fp8 import flashmla_page_bytes
from custom_ops.layouts.rope import precompute_freqs

MAX_POS = 64
DEV = "cuda"
EDGES = True  # out-of-range slots and positions mixed in (CUDA skips them; the CPU path would raise)


def slots_with_edges(n: int, capacity: int, gen: torch.Generator) -> torch.Tensor:
    """n slots: distinct valid ones (-1 once the capacity is used up), with a negative, a just-out-of-range and a
    huge slot mixed in where n allows."""
    slots = torch.full((n,), -1, dtype=torch.int64)
    valid = torch.randperm(capacity, generator=gen)[:n]
    slots[: valid.numel()] = valid
    edges = [-1, capacity, 2**62 + 7] if EDGES else [-1]
    for i, value in enumerate(edges[: n // 3]):
        slots[3 * i + 1] = value
    return slots


def positions_with_edges(n: int, gen: torch.Generator) -> torch.Tensor:
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    if n >= 4 and EDGES:
        pos[1], pos[3] = -1, MAX_POS
    return pos


def flashmla_ops(gen: torch.Generator) -> None:
    freqs = precompute_freqs(MAX_POS, device=DEV)
    for page_size in (1, 64):
        num_pages = 3
        cache = torch.zeros(num_pages, flashmla_page_bytes(page_size), dtype=torch.uint8, device=DEV)
        for b in (0, 1, 7, 33):
            for dtype in (torch.bfloat16, torch.float32):
                for index_dtype in (torch.int32, torch.int64):
                    wide = torch.randn(b, 640, generator=gen).to(dtype).to(DEV)
                    if b >= 7:  # the quantizers' non-finite rule: a NaN and an infinity in one 64-wide tile
                        wide[1, 70], wide[1, 71] = float("nan"), float("inf")
                    kv = wide[:, 64:576]  # row-strided view
                    weight = torch.randn(512, generator=gen).to(dtype).to(DEV)
                    pos = positions_with_edges(b, gen).to(index_dtype).to(DEV)
                    loc64 = slots_with_edges(b, num_pages * page_size, gen)
                    loc = (loc64.clamp(max=2**31 - 1) if index_dtype == torch.int32 else loc64).to(index_dtype)
                    loc = loc.to(DEV)
                    torch.ops.dspark.fused_k_norm_rope_flashmla(kv, weight, 1e-6, freqs, pos, loc, cache, page_size)
                    torch.ops.dspark.store_flashmla_cache(kv, loc, cache, page_size)
                    inplace = kv.clone()
                    torch.ops.dspark.fused_norm_rope_inplace(inplace, weight, 1e-6, freqs, pos)
                    q = torch.randn(b, 3, 512, generator=gen).to(dtype).to(DEV)
                    q_out = torch.empty_like(q)
                    torch.ops.dspark.fused_q_norm_rope(q, q_out, 1e-6, freqs, pos)
                    qi = torch.randn(b, 5, 128, generator=gen).to(dtype).to(DEV)
                    wi = torch.randn(b, 5, generator=gen).to(dtype).to(DEV)
                    torch.ops.dspark.fused_q_indexer_rope_hadamard_quant(qi, wi, 0.1, freqs, pos)


def dsv4_compressor(gen: torch.Generator, ratio: int, online: bool, paged: bool, head_dim: int) -> None:
    hidden = 64
    comp = DSV4Compressor(hidden, head_dim, ratio, online=online, device=DEV)
    comp.reset_parameters(gen)
    comp.to(DEV)
    bs, rids = 3, torch.tensor([2, -1, 0], device=DEV)
    addressing = None
    if paged:
        ctx, swa_page = 1024, 256
        req_to_token = torch.arange(bs * ctx, dtype=torch.int32, device=DEV).view(bs, ctx)
        full_to_state = torch.arange(bs * ctx, device=DEV)
        full_to_state[:swa_page] = -1  # request 0's first SWA page evicted: its later windows read unmapped rows
        addressing = PagedAddressing(req_to_token, full_to_state, swa_page)
        state = comp.new_state(num_rows=(bs * ctx // swa_page) * comp.window)
    else:
        state = comp.new_state(bs)
    fp4 = head_dim == 128 and not online
    page_size = 64
    cache = torch.zeros(4, cache_page_bytes(head_dim, page_size, fp4), dtype=torch.uint8, device=DEV)
    freqs = precompute_freqs(4 * ratio + 8, device=DEV)
    seq = torch.zeros(bs, dtype=torch.int64, device=DEV)
    for lens in ([ratio + 1, 2, 2 * ratio], [ratio - 1, 3, 1]):
        ext = torch.tensor(lens, device=DEV)
        seq = seq + ext
        x = torch.randn(int(ext.sum()), hidden, generator=gen).to(DEV)
        out = comp(x, state, seq, rids, extend_lens=ext, addressing=addressing)
        loc = slots_with_edges(x.shape[0], cache.shape[0] * page_size, gen).to(DEV)
        comp.store(out, freqs, loc, cache, page_size, fp4=fp4)
    for _ in range(ratio + 1):
        seq = seq + 1
        x = torch.randn(bs, hidden, generator=gen).to(DEV)
        out = comp(x, state, seq, rids, addressing=addressing)
        loc = slots_with_edges(bs, cache.shape[0] * page_size, gen).to(DEV)
        comp.store(out, freqs, loc, cache, page_size, fp4=fp4)


def multi_linear(gen: torch.Generator) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        weights = [torch.randn(rows, 256, generator=gen).to(dtype).to(DEV) for rows in (48, 17, 64)]
        biases = [None, torch.randn(17, generator=gen).to(dtype).to(DEV), None]
        for tokens in (0, 1, 7, 16, 64, 65):
            x = torch.randn(tokens, 320, generator=gen).to(dtype).to(DEV)[:, 32:288]
            torch.ops.dspark.multi_linear(x, weights, [0, 1, 8], [48, 16, 40], biases)
        # the cuBLAS path's row blocks: ranges of three shapes in one batched GEMM (its pointer-table kernel), and a
        # single range of 4096 rows in a strided batched GEMM
        blocks = [torch.randn(rows, 64, generator=gen).to(dtype).to(DEV) for rows in (512, 256, 256, 4096)]
        for tokens in (1, 16, 65):
            x = torch.randn(tokens, 64, generator=gen).to(dtype).to(DEV)
            torch.ops.dspark.multi_linear(x, blocks[:3], [0, 0, 0], [512, 256, 256], [None] * 3)
            torch.ops.dspark.multi_linear(x, blocks[3:], [0], [4096], [None])
        if DEV != "cuda":
            continue
        if torch.cuda.get_device_capability() == (9, 0):
            # the streaming kernel forced (the 4096-row range above streams at 1 token): a ragged last stage of columns,
            # ranges that split 16-row blocks, a partial last block, one and two token tiles
            ragged = [torch.randn(rows, 1000, generator=gen).to(dtype).to(DEV) for rows in (40, 300, 17)]
            ragged_biases = [torch.randn(300, generator=gen).to(dtype).to(DEV) if i == 1 else None for i in range(3)]
            for tokens in (1, 9, 16):
                x = torch.randn(tokens, 1000, generator=gen).to(dtype).to(DEV)
                torch.ops.dspark._multi_linear_variant(x, ragged, [0, 0, 0], [40, 300, 17], ragged_biases, -2, 0)
        # the batched GEMM captured into a CUDA graph: its pointer table copied once at capture time, then replayed
        # (its output stays referenced: with the caching allocator off, a free inside the capture is a cudaFree; the
        # relaxed mode lets that allocator's cudaMalloc run inside the capture). Its results are not read back here
        # (see the module docstring); tests/test_multi_linear_cuda.py checks replays against the fp64 formula.
        x = torch.randn(16, 64, generator=gen).to(dtype).to(DEV)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="relaxed"):
            captured = torch.ops.dspark.multi_linear(x, blocks[:3], [0, 0, 0], [512, 256, 256], [None] * 3)
        for _ in range(2):
            x.copy_(torch.randn(16, 64, generator=gen).to(dtype))
            graph.replay()
            torch.ops.dspark.multi_linear(x, blocks[:3], [0, 0, 0], [512, 256, 256], [None] * 3)
        del captured  # freed after the replays, not inside the capture


def multi_linear_kv_write(gen: torch.Generator) -> None:
    """The fused kernel (head_dim 64 / 128, T <= 16; hidden 64 gives each of its 2 k-warps one chunk); the GEMM path
    (T > 16, or head_dim 80) with the three heads kernels: the general one with a
    warp per unit (up to a few thousand units) or the ring of persistent warps (at 701 tokens, 4206 units, on an
    H100 or H200), and, where every norm weight is bf16 (or there is no norm) and RoPE covers the whole head, the one
    compiled for the call's form (neox from a halves table or inverse frequencies, GPT-J from a pairs or a halves
    table; in one wave at 17 and 40 tokens, in several at 701): neox and GPT-J with partial rotary, a bias, fp32 and
    bf16 norm weights, 1-D slots and [B, 2] slots with commit lengths, edge slots and positions, both position
    dtypes, caches with padded rows, x with a row stride."""
    layers, heads, slots, bf16 = 3, 2, 96, torch.bfloat16
    configs = (  # head_dim, hidden, rotary dim, neox, norm weights (layer 0's fp32, all bf16, or no norm), table
        # form, token counts
        (64, 64, 64, True, "fp32 first", "halves", (0, 1, 7, 16, 17, 40, 64, 65, 701)),  # K 64: a chunk per k-warp
        (64, 64, 64, True, "bf16", "halves", (17, 40, 701)),
        (64, 64, 64, True, "bf16", "frequencies", (17, 701)),
        (64, 64, 64, False, "bf16", "pairs", (17, 701)),
        (64, 64, 64, False, "bf16", "halves", (17,)),
        (64, 64, 64, True, "none", "halves", (17, 701)),
        (128, 256, 64, False, "fp32 first", "halves", (5, 33)),
        (80, 256, 40, True, "fp32 first", "halves", (3, 19)),
    )
    for head_dim, hidden, rot, neox, norm, form, token_counts in configs:
        kv = heads * head_dim
        weights = [(torch.randn(3 * kv, hidden, generator=gen) * hidden**-0.5).to(bf16).to(DEV) for _ in range(layers)]
        biases = [torch.randn(3 * kv, generator=gen).to(bf16).to(DEV) if i == 0 else None for i in range(layers)]
        norms = [
            (torch.rand(head_dim, generator=gen) + 0.5).to(torch.float32 if i == 0 and norm == "fp32 first" else bf16)
            for i in range(layers)
        ]
        norms, eps = ([None] * layers, []) if norm == "none" else ([w.to(DEV) for w in norms], [1e-6] * layers)
        shape = {"halves": (MAX_POS, rot), "pairs": (MAX_POS, rot // 2, 2), "frequencies": (rot // 2,)}[form]
        tables = [torch.randn(*shape, generator=gen).to(DEV) for _ in range(layers)]
        for tokens in token_counts:
            x = torch.randn(tokens, hidden + 16, generator=gen).to(bf16).to(DEV)[:, 16:]
            caches = [
                torch.zeros(slots, heads, head_dim + 8, dtype=bf16, device=DEV)[..., :head_dim]
                for _ in range(2 * layers)
            ]
            pos = positions_with_edges(tokens, gen).to(torch.int32 if tokens % 3 == 0 else torch.int64).to(DEV)
            loc, commit = slots_with_edges(tokens, slots, gen), None
            if tokens > 0 and tokens % 2 == 0:
                loc, commit = loc.reshape(-1, 2), torch.randint(0, 3, (tokens // 2,), generator=gen).to(DEV)
            torch.ops.dspark.multi_linear_kv_write(
                x,
                weights,
                [kv] * layers,
                biases,
                weights,
                [2 * kv] * layers,
                biases,
                norms,
                eps,
                tables,
                pos,
                neox,
                caches[:layers],
                caches[layers:],
                loc.to(DEV),
                commit,
                heads,
                head_dim,
            )


# (hidden, K/V heads, head_dim, query rows) of the write benchmark's configs (benchmarks/dspark_write.py: Qwen3-8B,
# Qwen3-4B, head_dim 64); 5 layers, 8192 slots, 4096 positions, its token counts
BENCHMARK_DIMS = ((4096, 8, 128, 4096), (2560, 8, 128, 4096), (7168, 16, 64, 4096))
BENCHMARK_TOKENS = (1, 8, 64, 512, 4096)


def write_at_benchmark_dims(
    gen: torch.Generator,
    dims: tuple[tuple[int, int, int, int], ...] = BENCHMARK_DIMS,
    token_counts: tuple[int, ...] = BENCHMARK_TOKENS,
    layers: int = 5,
    slots: int = 8192,
    positions: int = 4096,
) -> None:
    """The context-K/V write as the write benchmark's compiled drafts make it, at its dims, eagerly: per layer a
    [q + 2 kv, hidden] bf16 q/k/v weight, K and V its row ranges; the lowered write (`multi_linear_kv_write`: the
    fused kernel, or the GEMM and the heads kernel) and the never-lowered path's GEMM (`multi_linear` over the 2 x
    layers K/V row ranges). Not in the default groups (large: hundreds of MB of weights, GEMMs of T = 4096): a check
    that the kernels stay inside their tensors at the sizes the benchmark runs, with one allocation per tensor."""
    bf16 = torch.bfloat16
    for hidden, heads, head_dim, q_rows in dims:
        kv = heads * head_dim
        weights = [
            (torch.randn(q_rows + 2 * kv, hidden, generator=gen) * hidden**-0.5).to(bf16).to(DEV) for _ in range(layers)
        ]
        norms = [(torch.rand(head_dim, generator=gen) + 0.5).to(bf16).to(DEV) for _ in range(layers)]
        table = torch.randn(positions, head_dim, generator=gen).to(DEV)
        caches = [torch.randn(slots, heads, head_dim, generator=gen).to(bf16).to(DEV) for _ in range(2 * layers)]
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, generator=gen).to(bf16).to(DEV)
            pos = torch.randint(0, positions, (tokens,), generator=gen).to(DEV)
            loc = torch.randperm(slots, generator=gen)[:tokens].to(DEV)
            torch.ops.dspark.multi_linear_kv_write(
                x,
                weights,
                [q_rows] * layers,
                [None] * layers,
                weights,
                [q_rows + kv] * layers,
                [None] * layers,
                norms,
                [1e-6] * layers,
                [table] * layers,
                pos,
                True,
                caches[:layers],
                caches[layers:],
                loc,
                None,
                heads,
                head_dim,
            )
            starts = [q_rows + kind * kv for _ in range(layers) for kind in (0, 1)]
            torch.ops.dspark.multi_linear(
                x, [w for w in weights for _ in (0, 1)], starts, [kv] * len(starts), [None] * len(starts)
            )


GROUPS = ("flashmla", "dsv4", "multi_linear", "multi_linear_kv_write")
OPT_IN_GROUPS = ("benchmark_dims",)  # made only when named with --only


def main(argv: list[str] | None = None) -> None:
    global DEV, EDGES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=GROUPS + OPT_IN_GROUPS,
        help=f"make only these groups of calls (default: all of them but {', '.join(OPT_IN_GROUPS)})",
    )
    args = parser.parse_args(argv)
    DEV = args.device
    EDGES = DEV == "cuda"
    if DEV == "cuda":
        _build.load()
    gen = torch.Generator().manual_seed(0)
    groups = args.only or GROUPS
    if "flashmla" in groups:
        flashmla_ops(gen)
    if "dsv4" in groups:
        for ratio, online, paged in (
            (4, False, False),
            (4, False, True),
            (128, False, False),
            (128, False, True),
            (128, True, False),
        ):
            for head_dim in (512, 128):
                dsv4_compressor(gen, ratio, online, paged, head_dim)
    if "multi_linear" in groups:
        multi_linear(gen)
    if "multi_linear_kv_write" in groups:
        multi_linear_kv_write(gen)
    if "benchmark_dims" in groups:
        write_at_benchmark_dims(gen)
    if DEV == "cpu":
        print("sanitize driver: all calls made on the CPU")
        return
    with custom_ops.checks():
        loc = torch.tensor([0, 10**9], device=DEV)
        cache = torch.zeros(1, flashmla_page_bytes(64), dtype=torch.uint8, device=DEV)
        try:
            torch.ops.dspark.store_flashmla_cache(torch.randn(2, 512, device=DEV), loc, cache, 64)
        except ValueError as e:
            print("checking mode raised:", e)
    torch.cuda.synchronize()
    print("sanitize driver: all kernels called")


if __name__ == "__main__":
    main()
