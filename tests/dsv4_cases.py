"""DeepSeek-V4 compressor test cases: an independent fp64 whole-sequence ground truth, a driver that feeds one
batch of sequences through the stateful ops call by call (prefill, extends, decodes), random inputs, a caller of
an op's real or fake impl, the store op's fp64 expectation and byte checks, and the out-of-range cases of the
input contract (corrupted plan rows, planner problems, store slots past the cache) shared by the kernel-emulation
and CUDA contract tests.

The ground truth is written from the formula in docs/dsv4_compress.md ("Reference formula and scenarios"),
window by window in fp64, not from the ops' CPU references.
"""

from __future__ import annotations

import contextlib
import math

import torch
from flashmla_cases import negative_nan
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops  # noqa: F401
from custom_ops.dsv4.common import read_compress_plan
from custom_ops.dsv4.compress import compress_decode, compress_prefill
from custom_ops.dsv4.compressor import DSV4Compressor
from custom_ops.dsv4.online import online_compress_decode, online_compress_prefill
from custom_ops.dsv4.plan import (
    plan_decode,
    plan_online_decode,
    plan_online_prefill,
    plan_prefill,
)
from custom_ops.dsv4.store import cache_page_bytes, row_slots, stored_rows
from custom_ops.layouts.fp8 import dequantize_flashmla_cache
from custom_ops.layouts.rope import precompute_freqs

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
    """A batch of `bs` sequences pushed through the ops; records every produced entry by (request, window) and
    counts those produced by decode calls (`decode_entries`).

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
        self.decode_entries = 0
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
                    self.decode_entries += 1
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


def call_op(op, args: dict, fake: bool):
    """Call a registered op on real tensors, or (fake) on fake copies: its fake impl, which torch.compile runs."""
    if not fake:
        return op(*args.values())
    with FakeTensorMode() as mode:
        return op(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args.values()])


EPS = 1e-6


FREQS = precompute_freqs(4096, 64, 160000.0, original_seq_len=65536, factor=16.0)


def _expected(x: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """fp64: RMSNorm, interleaved RoPE of the last 64 dims at `pos`, optional normalized Hadamard."""
    x = x.double()
    y = x / torch.sqrt(x.square().mean(1, keepdim=True) + EPS) * w.double()
    d = y.shape[1]
    t = FREQS[pos].double()
    c, s = t[:, 0::2], t[:, 1::2]
    re, im = y[:, d - 64 :: 2], y[:, d - 63 :: 2]
    rot = torch.stack([re * c - im * s, re * s + im * c], -1).flatten(1)
    y = torch.cat([y[:, : d - 64], rot], 1)
    if hadamard:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        y = y @ h.T / math.sqrt(d)
    return y


# the e2m1 magnitudes, written out independently of custom_ops.layouts.fp4
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _decode_indexer(cache: torch.Tensor, page_size: int, slots: torch.Tensor) -> torch.Tensor:
    flat = cache.view(-1)
    out = []
    for loc in slots.tolist():
        base = (loc // page_size) * cache.shape[1]
        off = loc % page_size
        codes = flat[base + off * 128 : base + off * 128 + 128].view(torch.float8_e4m3fn).double()
        scale = flat[base + 128 * page_size + off * 4 : base + 128 * page_size + off * 4 + 4].view(torch.float32)
        out.append(codes * scale.double())
    return torch.stack(out)


def _decode_indexer_fp4(cache: torch.Tensor, page_size: int, slots: torch.Tensor):
    """fp64 values and the per-32 scales 2^(e-127) of FP4 indexer slots (nibbles: even element low, bit 3 sign)."""
    flat = cache.view(-1)
    values, scales = [], []
    for loc in slots.tolist():
        base = (loc // page_size) * cache.shape[1]
        off = loc % page_size
        row = []
        for byte in flat[base + off * 64 : base + off * 64 + 64].tolist():
            for nibble in (byte & 0xF, byte >> 4):
                row.append(-E2M1[nibble & 7] if nibble & 8 else E2M1[nibble & 7])
        exps = flat[base + 64 * page_size + off * 4 : base + 64 * page_size + off * 4 + 4].double()
        scale = torch.pow(2.0, exps - 127)
        values.append(torch.tensor(row, dtype=torch.float64) * scale.repeat_interleave(32))
        scales.append(scale)
    return torch.stack(values), torch.stack(scales)


def _touched(cache: torch.Tensor, page_size: int, slots: list[int], d: int, fp4: bool) -> torch.Tensor:
    """Mask of the bytes the store may write for `slots` (payload regions only)."""
    mask = torch.zeros(cache.numel(), dtype=torch.bool)
    codes = 64 if fp4 else 128
    for loc in slots:
        base = (loc // page_size) * cache.shape[1]
        off = loc % page_size
        if d == 512:
            mask[base + off * 576 : base + off * 576 + 576] = True
            mask[base + page_size * 576 + off * 8 : base + page_size * 576 + off * 8 + 7] = True
        else:
            mask[base + off * codes : base + off * codes + codes] = True
            mask[base + codes * page_size + off * 4 : base + codes * page_size + off * 4 + 4] = True
    return mask


def _check_fp4(got: torch.Tensor, scales: torch.Tensor, want: torch.Tensor) -> None:
    """Per group of 32: the scale is the smallest power of two >= amax / 6, every value the nearest e2m1 step."""
    groups = want.reshape(-1, 4, 32)
    floor = groups.abs().amax(-1).clamp(min=1e-4) / 6
    assert (scales >= floor * (1 - 1e-6)).all() and (scales < 2 * floor * (1 + 1e-6)).all()
    v = groups.abs() / scales[..., None]
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0)) * scales[..., None]
    err = (got.reshape(-1, 4, 32) - groups).abs()
    assert (err <= half_step * (1 + 1e-5) + 1e-7).all(), (err / half_step).amax()


def assert_cache_bytes_close(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """CUDA and CPU caches agree byte for byte except for rare rounding ties (an FP8 code one step apart): a few
    bytes per call, or one in 100,000 for large caches."""
    diff = (got.cpu() != want.cpu()).sum().item()
    assert diff <= max(4, want.numel() // 100000), f"{what}{diff} cache bytes differ from the CPU path"


def check_store(kv, w, pos, slots, cache, before, page_size, fp4=False):
    d = kv.shape[1]
    want = _expected(kv, w, pos, hadamard=d == 128)
    untouched = ~_touched(cache, page_size, slots.tolist(), d, fp4)
    assert torch.equal(cache.view(-1)[untouched], before.view(-1)[untouched]), "bytes outside the slots changed"
    if fp4:
        _check_fp4(*_decode_indexer_fp4(cache, page_size, slots), want)
    elif d == 512:
        got = dequantize_flashmla_cache(cache, page_size, slots).double()
        tiles = want[:, :448].reshape(-1, 7, 64).abs().amax(-1).clamp(min=1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(tiles / 448)))
        err = (got[:, :448] - want[:, :448]).reshape(-1, 7, 64).abs()
        assert (err <= scale[..., None] * 18).all(), (err / scale[..., None]).amax((1, 2))  # half ulp + bf16
        torch.testing.assert_close(got[:, 448:], want[:, 448:], atol=1e-2, rtol=8e-3)
    else:
        got = _decode_indexer(cache, page_size, slots)
        amax = want.abs().amax(1, keepdim=True)
        assert ((got - want).abs() <= amax / 448 * 16 + 1e-6).all()


INVALID_C = [-1, 0, -1, -1]  # CompressPlan padding row as int32 words


INVALID_D = [-1, -1, -1, -1]  # DecodePlan padding row


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def decode_corruptions(ratio: int, online: bool, rows: int):
    """(field, corrupt): `corrupt(bad, neutral)` edits the int32 words of two copies of a decode plan: `bad` gets an
    out-of-range row, `neutral` the same row as the CPU path accepts it with the effect a skipping kernel has
    (padding; or, for a row whose window read is bad, a row that writes but does not close its window)."""
    if online:

        def loads(w):
            return (w[:, 1] >= 0) & ((w[:, 0] - 1) % 128 != 0)

        def write_loc(bad, good):
            r = _first(bad[0][:, 1] >= 0)
            bad[0][r, 1] = rows
            good[0][r] = torch.tensor(INVALID_D)

        def read_page_0(bad, good):
            r = _first(loads(bad[0]))
            bad[0][r, 2] = rows + 1
            good[0][r] = torch.tensor(INVALID_D)

        return [("write_loc", write_loc), ("read_page_0", read_page_0)]

    def emitting(w):
        return (w[:, 1] >= 0) & (w[:, 0] % ratio == 0)

    def write_loc(bad, good):
        r = _first(bad[0][:, 1] >= 0)
        bad[0][r, 1] = rows + 5
        good[0][r] = torch.tensor(INVALID_D)

    def page(col, value):
        def corrupt(bad, good):
            r = _first(emitting(bad[0]))
            bad[0][r, col] = value
            good[0][r, 0] += 1  # writes the row, closes no window

        return corrupt

    def not_last_row(bad, good):
        r = _first(emitting(bad[0]))
        bad[0][r, 1] -= 1
        good[0][r, 1] -= 1
        good[0][r, 0] += 1

    cases = [("write_loc", write_loc), ("read_page_1", page(3, rows // ratio + 3)), ("write_loc", not_last_row)]
    # c4: a negative read_page_0 is an unmapped overlap (no entry, no error); past the state it is out of range
    return [*cases, ("read_page_0", page(2, rows // ratio + 5))] if ratio == 4 else cases


def prefill_corruptions(ratio: int, online: bool, rows: int, inputs: int):
    """As `decode_corruptions`, for the two plans of a prefill (every corrupted row becomes padding)."""
    window = 8 if ratio == 4 else 128

    def field(plan: int, col: int, value, pick=lambda w: w[:, 0] != -1, keep=0):
        """Set the bits of word `col` outside `keep` to `value` in the first row of `plan` that `pick` selects."""

        def corrupt(bad, good):
            r = _first(pick(bad[plan]))
            bad[plan][r, col] = (bad[plan][r, col] & keep) | value
            good[plan][r] = torch.tensor(INVALID_C if online or plan == 0 else [-1, -1])

        return corrupt

    def buffered(w):
        return (w[:, 0] != -1) & ((w[:, 1] >> 16) > 0)

    ragged = ("ragged_id", field(0, 1, inputs + 1, keep=~0xFFFF))
    buffer_len = field(0, 1, 0 if online else (window + 1) << 16, keep=0xFFFF)
    if online:
        return [
            ragged,
            ("buffer_len", buffer_len),
            ("buffer_len", field(1, 1, 129 << 16, keep=0xFFFF)),
            ("read_page_0", field(1, 2, rows)),
            ("read_page_1", field(0, 3, rows + 4)),
        ]
    return [
        ragged,
        ("buffer_len", buffer_len),
        ("ragged_id", field(0, 1, 0)),  # ragged id 0, buffer_len 0: the window starts before row 0
        ("read_page_1", field(0, 3, -2, buffered)),
        ("write_loc", field(1, 1, rows)),
        ("ragged_id", field(1, 0, inputs)),
    ]


def plan_corruptions(ratio: int, online: bool, decode: bool, state: torch.Tensor, kv: torch.Tensor):
    """`decode_corruptions` or `prefill_corruptions` for the buffers of a `corruption_case`."""
    if decode:
        return decode_corruptions(ratio, online, state.shape[0])
    return prefill_corruptions(ratio, online, state.shape[0], kv.shape[0])


def corruption_case(ratio: int, online: bool, decode: bool, g: torch.Generator):
    """A random state, input and ape, and valid plans of 3-4 requests of which at least two produce an entry: a
    corruption hits one row, so another row's entry is still compared."""
    d = 128
    window = 8 if ratio == 4 else 128
    ring = 1 if online else window
    state = torch.randn(5 * ring, 3 * d if online else (4 if ratio == 4 else 2) * d, generator=g)
    if online:
        state[:, d : 2 * d] = state[:, d : 2 * d].abs() + 1
    ape = torch.randn(window, d, generator=g)
    in_width = (4 if ratio == 4 else 2) * d
    r = ratio
    if decode:
        seq = torch.tensor([128, 200, 256, 129] if online else [r, 2 * r, 2 * r + 1, 3 * r])
        rid = torch.arange(4)
        plans = (plan_online_decode(seq, rid),) if online else (plan_decode(seq, rid, None, None, r, ring),)
        return state, torch.randn(4, in_width, generator=g), ape, plans
    seq, ext = ([300, 128, 5], [200, 128, 1]) if online else ([2 * r + 3, 3 * r, r + 1], [r + 5, 2 * r, 2])
    seq, ext, rid = torch.tensor(seq), torch.tensor(ext), torch.arange(3)
    n = int(ext.sum()) + 2
    plans = plan_online_prefill(seq, ext, rid, n) if online else plan_prefill(seq, ext, rid, None, None, r, ring, 0, n)
    return state, torch.randn(n, in_width, generator=g), ape, plans


def run_compress(online, decode, state, kv, ape, plans, ratio):
    """The registered compress op of (online, decode) on the tensors' device."""
    ops = torch.ops.dspark
    if online:
        op = ops.dsv4_online_compress_decode if decode else ops.dsv4_online_compress_prefill
        return op(state, kv, ape, *plans)
    op = ops.dsv4_compress_decode if decode else ops.dsv4_compress_prefill
    return op(state, kv, ape, *plans, ratio)


def planner_problem_stages():
    """Planner inputs (seq, ext, rid, r2t, f2s, num_q_tokens) with every kind of out-of-range value, fixed one kind
    at a time, so that stage k's first problem has rank k (ERR_*); the paged tables also hold unmapped entries."""
    g = torch.Generator().manual_seed(5)
    batch = 40
    seq = torch.randint(1, 600, (batch,), generator=g)
    ext = torch.minimum(seq, torch.randint(1, 40, (batch,), generator=g))
    rid = torch.arange(batch) % 11 - 1
    picks = torch.randperm(batch, generator=g)[:6].tolist()
    good_ext = ext.clone()
    ext[picks[0]], ext[picks[1]] = -3, 70000
    seq[picks[2]] = 2**40  # past int32 positions
    rid[picks[3]], rid[picks[4]] = 2**33 + 1, 2**62  # wrap in int32, overflow int64 when multiplied
    rid[picks[5]], seq[picks[5]] = 2, ext[picks[5]] - 1  # shorter than its extend
    r2t = (torch.arange(10)[:, None] * 1024 + torch.arange(1024)).to(torch.int64)
    r2t[3] = 10 * 1024 + 7  # past full_to_state
    f2s = torch.arange(10 * 1024)
    f2s[5 * 1024 : 6 * 1024] = 2**45  # state rows beyond int32
    f2s[7 * 1024 + 10 : 7 * 1024 + 500] = -1  # unmapped: skipped, never reported
    tokens = int(good_ext.sum())
    stages = [
        (lambda: None, tokens - 5),
        (lambda: ext.copy_(good_ext), tokens - 5),  # the extends end past num_q_tokens
        (lambda: None, tokens),  # a seq_len shorter than its extend
        (lambda: seq.copy_(torch.maximum(seq, ext)), tokens),  # a seq_len past int32
        (lambda: seq.copy_(seq.clamp(max=600)), tokens),  # request ids
        (lambda: rid.copy_(torch.where(rid > 9, -1, rid)), tokens),  # req_to_token entries (paged)
        (lambda: r2t[3].copy_(torch.arange(3 * 1024, 4 * 1024)), tokens),  # full_to_state entries (paged)
    ]
    for change, n in stages:
        change()
        yield seq.clone(), ext.clone(), rid.clone(), r2t.clone(), f2s.clone(), n


STORE_FREQS = precompute_freqs(4096, 64, 160000.0, original_seq_len=65536, factor=16.0)


STORE_PAGE = 16


def store_case(d: int, fp4: bool, decode: bool):
    """Random entries, their plan (ratio 4), out_loc (some negative) and a poisoned cache of 32 pages of 16."""
    g = torch.Generator().manual_seed(d + decode)
    if decode:
        seq = torch.randint(1, 3000, (24,), generator=g)
        seq[::2] = (seq[::2] // 4 + 1) * 4
        plan = plan_decode(seq, torch.arange(24), None, None, 4, 8)
        out_loc = torch.randperm(500, generator=g)[:24] - 10
    else:
        seq, ext = torch.tensor([300, 41]), torch.tensor([200, 41])
        plan, _ = plan_prefill(seq, ext, torch.arange(2), None, None, 4, 8, 0, 241)
        out_loc = torch.randperm(500, generator=g)[:241] - 10
    kv = torch.randn(plan.shape[0], d, generator=g) * 3
    w = torch.rand(d, generator=g) + 0.5
    cache = torch.randint(0, 256, (32, cache_page_bytes(d, STORE_PAGE, fp4)), dtype=torch.uint8, generator=g)
    return kv, plan, w, out_loc.long(), cache


def storing_rows(plan, out_loc, decode):
    """Plan rows that store, and the out_loc index of each."""
    rows = stored_rows(plan, 4, decode)
    stores = rows.valid & (row_slots(rows, out_loc) >= 0)
    return stores.nonzero().squeeze(1), rows.source


def compress_setup(ratio: int, seed: int = 0, d: int = 128):
    """A random offline state of 4 rings and an ape table of head dim `d`; returns (state, ape, ring, generator)."""
    g = torch.Generator().manual_seed(seed)
    width = (4 if ratio == 4 else 2) * d
    ring = 8 if ratio == 4 else 128
    state = torch.randn(4 * ring, width, generator=g)
    ape = torch.randn(8 if ratio == 4 else 128, d, generator=g)
    return state, ape, ring, g


def plant_non_finite_rows(kv: torch.Tensor, plan: torch.Tensor, out_loc: torch.Tensor, decode: bool) -> torch.Tensor:
    """NaN, +inf, -inf and a NaN with its sign bit in element 5 of four stored rows of `kv` (fp32), +inf and -inf in
    elements 5 and 70 of a fifth; returns the slots of those rows."""
    rows, source = storing_rows(plan, out_loc, decode)
    picked = rows[:5]
    for row, value in zip(picked[:3].tolist(), (float("nan"), float("inf"), float("-inf")), strict=True):
        kv[row, 5] = value
    kv[picked[3], 5:6] = negative_nan(torch.float32)
    kv[picked[4], 5], kv[picked[4], 70] = float("inf"), float("-inf")
    return out_loc[source[picked]]


def store_slot_contents(cache: torch.Tensor, page_size: int, slots: torch.Tensor, d: int, fp4: bool):
    """(decoded fp64 values, scale bytes) of stored `slots`: the UE8M0 exponents (7 per slot for d = 512, 4 for FP4)
    or the fp32 scale's 4 bytes (FP8 indexer)."""
    flat = cache.reshape(-1)
    page, off = slots // page_size, slots % page_size
    base = page * cache.shape[1]
    if d == 512:
        values = dequantize_flashmla_cache(cache, page_size, slots).double()
        scales = base + page_size * 576 + off * 8
        return values, flat[scales[:, None] + torch.arange(7)]
    codes = 64 if fp4 else 128
    values = _decode_indexer_fp4(cache, page_size, slots)[0] if fp4 else _decode_indexer(cache, page_size, slots)
    scales = base + codes * page_size + off * 4
    return values, flat[scales[:, None] + torch.arange(4)]


def assert_same_store_coding(
    got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, d: int, fp4: bool, ties: int = 0
) -> None:
    """Caches (CPU, pages of STORE_PAGE) holding the same `slots`: the same scale bytes, the same decoded values, NaN
    where `want` has NaN (a NaN's payload aside), and the bytes outside those slots the same but for at most `ties`
    (FP8 codes one rounding tie apart, as `assert_cache_bytes_close` allows between CUDA and CPU)."""
    got_values, got_scales = store_slot_contents(got, STORE_PAGE, slots, d, fp4)
    want_values, want_scales = store_slot_contents(want, STORE_PAGE, slots, d, fp4)
    assert torch.equal(got_scales, want_scales)
    torch.testing.assert_close(got_values, want_values, rtol=0, atol=0, equal_nan=True)
    outside = ~_touched(want, STORE_PAGE, slots.tolist(), d, fp4)
    assert (got.reshape(-1)[outside] != want.reshape(-1)[outside]).sum() <= ties


def decode_args(ratio: int = 4) -> dict:
    """Valid arguments of `dsv4_compress_decode` (CPU, schema order): two requests on a state of four rings."""
    state, ape, ring, g = compress_setup(ratio)
    kv = torch.randn(2, state.shape[1], generator=g)
    plan = plan_decode(torch.tensor([4, 9]), torch.tensor([0, 1]), None, None, ratio, ring)
    return {"state": state, "kv_score": kv, "ape": ape, "plan": plan, "ratio": ratio}


# (id, change(args) in place, error class, the argument the message names first): structural errors of
# `dsv4_compress_decode` on `decode_args()` (tests/test_dsv4_ops.py; tests/bad_argument_cases.py runs them on the
# Python checks and on the CUDA binding).
DECODE_BAD_STRUCTURE = [
    ("ratio 8", lambda a: a.update(ratio=8), ValueError, "ratio"),
    ("state fp16", lambda a: a.update(state=a["state"].half()), TypeError, "state"),
    ("state width", lambda a: a.update(state=a["state"][:, :-1]), ValueError, "state"),
    ("state rows", lambda a: a.update(state=a["state"][:-1]), ValueError, "state"),
    ("kv_score fp64", lambda a: a.update(kv_score=a["kv_score"].double()), TypeError, "kv_score"),
    ("kv_score half width", lambda a: a.update(kv_score=a["kv_score"][:, ::2]), ValueError, "kv_score"),
    ("ape rows", lambda a: a.update(ape=a["ape"][:4]), ValueError, "ape"),
    ("ape bf16", lambda a: a.update(ape=a["ape"].bfloat16()), TypeError, "ape"),
    ("ape transposed", lambda a: a.update(ape=a["ape"].t().contiguous().t()), ValueError, "ape"),
    ("plan int32", lambda a: a.update(plan=a["plan"].view(torch.int32)), TypeError, "plan"),
    ("plan rows", lambda a: a.update(plan=a["plan"][:1]), ValueError, "plan"),
    ("plan width", lambda a: a.update(plan=a["plan"][:, :8].contiguous()), ValueError, "plan"),
]


def audit_skipped_requests(ratio: int, online: bool, d: int, device: str, kernels=contextlib.nullcontext) -> None:
    """A `DSV4Compressor` on `device` (its ops, or, inside `kernels()`, the kernels it routes them to) through a prefill
    and decode steps of a batch of 4 requests on a poisoned state for 2: request ids [0, 2, -1, 1] (2 is past the
    state, -1 padding), out_loc slots in range for every row (one valid row's slot -1) in a poisoned cache. Compared
    with the CPU compressor on ids [0, -1, -1, 1]: the rows of batch entries 1 and 2 are invalid (request / window
    -1) with zero entries, every other row, the state and the cache are the CPU's, and every byte of the slots of
    skipped rows (the past request's, the padding request's, the -1 slot's) is the poison, byte for byte."""
    g = torch.Generator().manual_seed(ratio + d + online)
    comp = DSV4Compressor(32, d, ratio, online=online)
    comp.reset_parameters(g)
    comp.norm_weight.data = torch.rand(d, generator=g) + 0.5
    want_state = comp.new_state(2)
    want_state.copy_(torch.randn(want_state.shape, generator=g))
    if online:
        want_state[:, d : 2 * d] = want_state[:, d : 2 * d].abs() + 1
    pages = 16 if ratio == 4 else 64
    want_cache = torch.randint(0, 256, (pages, cache_page_bytes(d, STORE_PAGE)), dtype=torch.uint8, generator=g)
    dev = DSV4Compressor(32, d, ratio, online=online, device=device)
    dev.load_state_dict(comp.state_dict())
    got_state, got_cache = want_state.to(device), want_cache.to(device)
    bad = torch.tensor([0, 2, -1, 1])
    neutral = torch.tensor([0, -1, -1, 1])
    seq = torch.tensor([9, 8, 7, 8]) if ratio == 4 else torch.tensor([130, 129, 128, 131])
    steps = [seq.clone()] + [None] * (4 if ratio == 4 else 2)
    for step, ext in enumerate(steps):
        seq = seq if ext is not None else seq + 1
        n = int(ext.sum()) if ext is not None else seq.numel()
        x = torch.randn(n, 32, generator=g)
        out_loc = torch.randperm(pages * STORE_PAGE, generator=g)[:n]
        out_loc[n - 1] = -1  # a valid request's last row: stores nothing
        want = comp(x, want_state, seq, neutral, ext)
        before = got_cache.cpu()
        with kernels():
            got = dev(x.to(device), got_state, seq.to(device), bad.to(device), None if ext is None else ext.to(device))
            dev.store(got, FREQS.to(device), out_loc.to(device), got_cache, STORE_PAGE)
        comp.store(want, FREQS, out_loc, want_cache, STORE_PAGE)
        what = f"step {step}"
        assert torch.equal(got.valid.cpu(), want.valid), what
        assert torch.equal(got.request.cpu(), want.request) and torch.equal(got.window.cpu(), want.window), what
        assert not bool(torch.isin(want.request, torch.tensor([1, 2])).any()), what
        assert not bool(got.entries[~got.valid].any()), f"{what}: an invalid row's entry is not zero"
        torch.testing.assert_close(got.entries.cpu(), want.entries, atol=1e-4, rtol=1e-4, msg=what)
        torch.testing.assert_close(got_state.cpu(), want_state, atol=1e-5, rtol=1e-5, msg=what)
        assert_cache_bytes_close(got_cache, want_cache, f"{what}: ")
        loc = out_loc[_source_rows(want).clamp(max=n - 1)]
        written = set(loc[want.valid & (loc >= 0)].tolist())
        skipped = [s for s in out_loc.tolist() if s >= 0 and s not in written]
        assert skipped, f"{what}: no skipped slot to check"
        mask = _touched(want_cache, STORE_PAGE, skipped, d, False)
        assert torch.equal(got_cache.cpu().reshape(-1)[mask], before.reshape(-1)[mask]), (
            f"{what}: a skipped slot changed"
        )


def _source_rows(out) -> torch.Tensor:
    """The out_loc index of every row of a compressor output."""
    if out.decode:
        return torch.arange(out.plan.shape[0])
    return read_compress_plan(out.plan).ragged_id
