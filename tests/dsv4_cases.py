"""DeepSeek-V4 compressor test cases: an independent fp64 whole-sequence ground truth, a driver that feeds one
batch of sequences through the stateful ops call by call (prefill, extends, decodes), and random inputs.

The ground truth is written from the formula in docs/dsv4_compress.md ("Reference formula and scenarios"),
window by window in fp64, not from the ops' CPU references.
"""

from __future__ import annotations

import math

import torch

import custom_ops  # noqa: F401
from custom_ops.dsv4_compress import compress_decode, compress_prefill
from custom_ops.dsv4_compress_common import read_compress_plan
from custom_ops.dsv4_compress_online import online_compress_decode, online_compress_prefill
from custom_ops.dsv4_compress_plan import (
    plan_decode,
    plan_online_decode,
    plan_online_prefill,
    plan_prefill,
)

SWA_PAGE = 256


def gt_compress(kvs: torch.Tensor, ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """fp64 entries `[L // ratio, D]` of one whole sequence `kvs [L, W]`, one window at a time (the formula of
    docs/dsv4_compress.md, "Reference formula and scenarios")."""
    kvs = kvs.double()
    ape = ape.double()
    d = ape.shape[1]
    outs = []
    for n in range(kvs.shape[0] // ratio):
        p = n * ratio + ratio - 1
        if ratio == 128:
            v = kvs[p - 127 : p + 1, :d]
            s = kvs[p - 127 : p + 1, d:] + ape
        else:
            if n == 0:
                v_ov = torch.zeros(4, d, dtype=torch.float64)
                s_ov = torch.full((4, d), -math.inf, dtype=torch.float64)
            else:
                v_ov = kvs[p - 7 : p - 3, :d]
                s_ov = kvs[p - 7 : p - 3, 2 * d : 3 * d]
            v = torch.cat([v_ov, kvs[p - 3 : p + 1, d : 2 * d]])
            s = torch.cat([s_ov, kvs[p - 3 : p + 1, 3 * d :]]) + ape
        w = torch.exp(s - s.max(0).values)
        outs.append((w * v).sum(0) / w.sum(0))
    return torch.stack(outs) if outs else kvs.new_zeros((0, d))


class Session:
    """A batch of `bs` sequences pushed through the ops; records every produced entry by (request, window).

    addressing: "ring" (per-request ring, ring size = window: the legacy layout) or "paged" (SWA-page rings
    with a shuffled page table). The state starts poisoned with NaN: a read of a row that was never written
    shows up as NaN in an entry.
    """

    def __init__(
        self,
        kvs: list[torch.Tensor],
        ape: torch.Tensor,
        ratio: int,
        addressing: str = "ring",
        online: bool = False,
        state_dtype: torch.dtype = torch.float32,
        max_ctx: int = 2048,
        seed: int = 0,
        device: str = "cpu",
    ):
        self.kvs, self.ratio, self.online, self.device = kvs, ratio, online, device
        self.ape = ape.to(device)
        self.bs = len(kvs)
        self.d = ape.shape[1]
        self.window = 8 if ratio == 4 else 128
        self.rids = torch.arange(self.bs) * 2 + 1  # request ids are not batch indices
        self.cur = [0] * self.bs
        self.entries: dict[tuple[int, int], torch.Tensor] = {}
        g = torch.Generator().manual_seed(seed)
        slots = 2 * self.bs + 2
        if online:
            self.state = torch.full((slots, 3 * self.d), math.nan, device=device)
            self.paged = None
            return
        self.ring = self.window
        if addressing == "paged":
            pages = slots * max_ctx // SWA_PAGE
            self.req_to_token = (torch.arange(slots)[:, None] * max_ctx + torch.arange(max_ctx)).to(torch.int32)
            perm = torch.randperm(pages, generator=g)
            full = torch.arange(slots * max_ctx)
            self.full_to_state = perm[full // SWA_PAGE] * SWA_PAGE + full % SWA_PAGE
            self.paged = (self.req_to_token.to(device), self.full_to_state.to(device))
            rows = pages * self.ring
        else:
            self.paged = None
            rows = slots * self.ring
        self.state = torch.full((rows, kvs[0].shape[1]), math.nan, dtype=state_dtype, device=device)

    def _addr(self):
        return self.paged if self.paged is not None else (None, None)

    def extend(self, lens: list[int], pad: int = 0, idx_dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """One prefill/extend call: request b gets its next lens[b] tokens; `pad` extra ragged rows."""
        assert all(0 <= n <= len(k) - c for n, k, c in zip(lens, self.kvs, self.cur, strict=True)), lens
        rows = [self.kvs[b][self.cur[b] : self.cur[b] + n] for b, n in enumerate(lens)]
        rows.append(torch.randn(pad, self.kvs[0].shape[1]))
        kv = torch.cat(rows).to(self.device)
        ext = torch.tensor(lens, dtype=idx_dtype, device=self.device)
        seq = torch.tensor([c + n for c, n in zip(self.cur, lens, strict=True)], dtype=idx_dtype, device=self.device)
        rid = self.rids.to(idx_dtype).to(self.device)
        n_q = kv.shape[0]
        if self.online:
            plan_c, plan_w = plan_online_prefill(seq, ext, rid, n_q)
            out = online_compress_prefill(self.state, kv, self.ape, plan_c, plan_w)
        else:
            plan_c, plan_w = plan_prefill(seq, ext, rid, *self._addr(), self.ratio, self.ring, SWA_PAGE, n_q)
            out = compress_prefill(self.state, kv, self.ape, plan_c, plan_w, self.ratio)
        out, ext, seq = out.cpu(), ext.cpu(), seq.cpu()
        starts = torch.cumsum(ext, 0) - ext
        c = read_compress_plan(plan_c.cpu())
        for k in c.valid.nonzero().squeeze(1).tolist():
            b = int(torch.searchsorted(starts, c.ragged_id[k], right=True)) - 1
            self._record(b, int(c.seq_len[k]), out[k])
        assert not c.valid[int(c.valid.sum()) :].any(), "plan_c valid rows must come first"
        self.cur = seq.tolist()
        return out

    def decode(self, active: list[bool] | None = None, idx_dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """One decode call: every active request gets its next token; inactive rows are padding."""
        active = active or [True] * self.bs
        assert all(c < len(k) for a, k, c in zip(active, self.kvs, self.cur, strict=True) if a)
        kv = torch.stack(
            [self.kvs[b][self.cur[b]] if a else torch.randn(self.kvs[0].shape[1]) for b, a in enumerate(active)]
        )
        kv = kv.to(self.device)
        seq = torch.tensor([c + 1 if a else 0 for c, a in zip(self.cur, active, strict=True)], dtype=idx_dtype)
        seq = seq.to(self.device)
        rid = torch.where(torch.tensor(active), self.rids, -1).to(idx_dtype).to(self.device)
        if self.online:
            out = online_compress_decode(self.state, kv, self.ape, plan_online_decode(seq, rid))
        else:
            plan = plan_decode(seq, rid, *self._addr(), self.ratio, self.ring, SWA_PAGE)
            out = compress_decode(self.state, kv, self.ape, plan, self.ratio)
        out = out.cpu()
        for b, a in enumerate(active):
            if a:
                self.cur[b] += 1
                if self.cur[b] % self.ratio == 0:
                    self._record(b, self.cur[b], out[b])
                else:
                    assert torch.equal(out[b], torch.zeros_like(out[b])), "rows without an entry must be zero"
            else:
                assert torch.equal(out[b], torch.zeros_like(out[b])), "padded rows must be zero"
        return out

    def _record(self, b: int, seq_len: int, row: torch.Tensor) -> None:
        assert seq_len % self.ratio == 0
        key = (b, seq_len // self.ratio - 1)
        assert key not in self.entries, f"entry {key} produced twice"
        self.entries[key] = row.clone()

    def check(self, atol: float = 1e-5, rtol: float = 1e-5) -> None:
        """Every complete window of every request was produced once and matches the fp64 ground truth."""
        for b in range(self.bs):
            gt = gt_compress(self.kvs[b][: self.cur[b]], self.ape.cpu(), self.ratio)
            got = [self.entries.get((b, n)) for n in range(gt.shape[0])]
            missing = [n for n, g in enumerate(got) if g is None]
            assert not missing, f"request {b}: windows {missing} were never produced"
            extra = [k for k in self.entries if k[0] == b and k[1] >= gt.shape[0]]
            assert not extra, f"request {b}: unexpected entries {extra}"
            if got:
                torch.testing.assert_close(torch.stack(got).double(), gt, atol=atol, rtol=rtol)


def make_inputs(ratio: int, d: int, lengths: list[int], seed: int, bf16_exact: bool = False):
    """Random raw projection rows per request and an ape table in kernel layout ([8|128, D])."""
    g = torch.Generator().manual_seed(seed)
    width = (4 if ratio == 4 else 2) * d
    kvs = [torch.randn(n, width, generator=g) for n in lengths]
    if bf16_exact:
        kvs = [k.bfloat16().float() for k in kvs]
    ape = torch.randn(8 if ratio == 4 else 128, d, generator=g)
    return kvs, ape
