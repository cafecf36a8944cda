"""DeepSeek-V4 KV compression, end to end: prefill -> extends -> decodes, checked against the whole sequence.

Runs a small batch of random sequences through a `DSV4Compressor` (c4, c128 and online c128) call by call:
one prefill of unaligned length, two extends, then single-token decodes, with the state kept between calls. The
entries each call produces are collected by (request, window) and compared with the stateless
`compress_sequence` of each whole sequence.

    python examples/dsv4_compress.py                 # CPU reference
    python examples/dsv4_compress.py --device cuda   # CUDA kernels (once built)
"""

from __future__ import annotations

import argparse

import torch

import custom_ops  # noqa: F401  (registers torch.ops.dspark.*)
from custom_ops.dsv4.compressor import DSV4Compressor, PagedAddressing, compress_sequence


def run(ratio: int, online: bool, paged: bool, device: str, hidden: int, head_dim: int, seed: int = 0) -> float:
    """Push three sequences through the compressor in pieces; returns the max abs error vs the whole sequence."""
    g = torch.Generator().manual_seed(seed)
    comp = DSV4Compressor(hidden, head_dim, ratio, online=online, device=device)
    comp.reset_parameters(g)
    comp.to(device)
    r = ratio
    prefill = [3 * r + 1, 2 * r - 1, 5]
    extends = [[r + 2, 1, 2 * r], [r - 1, 3 * r, 1]]
    decodes = r + 3
    total = [p + sum(e[b] for e in extends) + decodes for b, p in enumerate(prefill)]
    xs = [torch.randn(n, hidden, generator=g).to(device) for n in total]
    bs = len(xs)
    rids = torch.tensor([2, 0, 1], device=device)

    addressing = None
    if paged and not online:
        ctx, swa_page = 2048, 256
        req_to_token = torch.arange(bs * ctx, dtype=torch.int32, device=device).view(bs, ctx)
        full_to_state = torch.arange(bs * ctx, device=device)
        addressing = PagedAddressing(req_to_token, full_to_state, swa_page)
        state = comp.new_state(num_rows=(bs * ctx // swa_page) * comp.window)
    else:
        state = comp.new_state(bs)

    got: dict[tuple[int, int], torch.Tensor] = {}
    cur = [0] * bs

    def collect(out) -> None:
        for row in out.valid.nonzero().squeeze(1).tolist():
            got[(int(out.request[row]), int(out.window[row]))] = out.entries[row]

    for lens in [prefill, *extends]:
        x = torch.cat([xs[b][cur[b] : cur[b] + n] for b, n in enumerate(lens)])
        cur = [c + n for c, n in zip(cur, lens, strict=True)]
        seq = torch.tensor(cur, device=device)
        ext = torch.tensor(lens, device=device)
        collect(comp(x, state, seq, rids, extend_lens=ext, addressing=addressing))
    for _ in range(decodes):
        x = torch.stack([xs[b][cur[b]] for b in range(bs)])
        cur = [c + 1 for c in cur]
        collect(comp(x, state, torch.tensor(cur, device=device), rids, addressing=addressing))

    err = 0.0
    for b in range(bs):
        want = compress_sequence(comp.kv_score(xs[b]), comp.kernel_ape(), ratio)
        have = torch.stack([got[(b, n)] for n in range(want.shape[0])])
        assert len([k for k in got if k[0] == b]) == want.shape[0], "unexpected extra entries"
        err = max(err, (have - want).abs().max().item())
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--head-dim", type=int, default=512, choices=[128, 512])
    args = parser.parse_args()
    worst = 0.0
    for name, ratio, online, paged in [
        ("c4 ring", 4, False, False),
        ("c4 paged", 4, False, True),
        ("c128 ring", 128, False, False),
        ("c128 paged", 128, False, True),
        ("online c128", 128, True, False),
    ]:
        err = run(ratio, online, paged, args.device, args.hidden, args.head_dim)
        worst = max(worst, err)
        print(f"{name:12s} max |split - whole sequence| = {err:.2e}")
    if worst > 5e-3:
        raise SystemExit(f"FAILED: max error {worst:.2e} > 5e-3")
    print("OK")


if __name__ == "__main__":
    main()
