"""User-facing DeepSeek-V4 KV compressor: parameters, state, and one `forward` for prefill, extend and decode.

`DSV4Compressor` holds one layer's compressor parameters in checkpoint layout (`wkv_gate`, `ape`, the RMSNorm
weight) and ties the ops together: projection (`kv_score = x @ wkv_gate^T` in fp32), planning
(`dsv4_plan_*`), compression (`dsv4_compress_*` / `dsv4_online_compress_*`). The state buffer and the
request bookkeeping (`seq_lens`, `req_pool_indices`, page tables) belong to the caller, as in a serving
engine; everything stays on the device, with no host syncs, so a decode step can be captured in a CUDA graph.

```python
comp = DSV4Compressor(hidden_size=4096, head_dim=512, ratio=4)
state = comp.new_state(num_requests=8)
out = comp(x_prefill, state, seq_lens, req_pool_indices, extend_lens=extend_lens)   # prefill / extend
out = comp(x_decode, state, seq_lens, req_pool_indices)                             # decode (one token each)
out.entries[out.valid]  # compressed entries; out.request / out.window say whose and which window
comp.store(out, freqs, out_loc, kvcache, page_size)  # RMSNorm -> RoPE -> FP8 into a paged cache
```

`compress_sequence` is the stateless whole-sequence computation (docs/dsv4_compress.md) that every split of a sequence
into calls must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from custom_ops.checks import check_index_range, must_check_values
from custom_ops.dsv4.common import (
    FLT_MAX,
    HEAD_DIMS,
    STATE_DTYPES,
    check_index,
    check_ratio,
    check_tensor,
    decode_emits,
    read_compress_plan,
    read_decode_plan,
    skipped_rows,
    window_of,
)
from custom_ops.dsv4.compress import compress_decode, compress_prefill, decode_plan_problems, prefill_plan_problems
from custom_ops.dsv4.online import (
    online_compress_decode,
    online_compress_prefill,
    online_decode_plan_problems,
    online_segment_problems,
)
from custom_ops.dsv4.plan import (
    COMPRESS_INVALID,
    DECODE_INVALID,
    plan_decode,
    plan_online_decode,
    plan_online_prefill,
    plan_prefill,
)
from custom_ops.dsv4.store import compress_norm_rope_store


@dataclass(frozen=True)
class PagedAddressing:
    """SWA-page ring addressing of the offline state (docs/dsv4_compress.md): `state row = (swa // swa_page_size) *
    ring_size + swa % ring_size` with `swa = full_to_state[req_to_token[rid, pos]]`."""

    req_to_token: torch.Tensor
    full_to_state: torch.Tensor
    swa_page_size: int = 256


class CompressOutput(NamedTuple):
    """Result of one compressor call; row i of every field belongs together.

    | field | shape | dtype | meaning |
    |---|---|---|---|
    | entries | [rows, D] | fp32 | pooled entries (before norm/RoPE); zero where `valid` is False |
    | plan | [rows, 16] | uint8 | the DecodePlan (decode) or CompressPlan (prefill) row of each entry |
    | valid | [rows] | bool | the row holds an entry |
    | request | [rows] | int64 | batch index of the entry's request (-1 if invalid) |
    | window | [rows] | int64 | window index n of the entry (positions `[n*ratio, (n+1)*ratio)`; -1 if invalid) |
    | decode | | bool | which plan layout `plan` uses |
    | tokens | | int | rows of the step's input: query tokens (prefill/extend) or requests (decode) |

    A row is valid only if it holds an entry the compress op computed: rows of padding requests, of requests past
    the state and rows the CUDA kernels skip (plan values out of range, docs/contract.md) are invalid, with a zero
    entry, and `store` writes nothing for them.
    """

    entries: torch.Tensor
    plan: torch.Tensor
    valid: torch.Tensor
    request: torch.Tensor
    window: torch.Tensor
    decode: bool
    tokens: int


def kernel_ape(ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """Checkpoint `ape [ratio, coff*D]` -> kernel layout `[window, D]` (c4: overlap rows 0..3, fresh rows 4..7)."""
    if ratio == 4:
        d = ape.shape[1] // 2
        return torch.cat([ape[:, :d], ape[:, d:]], 0).float().contiguous()
    return ape.float().contiguous()


def compress_sequence(kv_score: torch.Tensor, ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """Stateless whole-sequence compression: `kv_score [L, W]`, kernel-layout `ape` -> fp32 `[L // ratio, D]`."""
    d = ape.shape[1]
    n = kv_score.shape[0] // ratio
    rows = kv_score[: n * ratio].float().reshape(n, ratio, kv_score.shape[1])
    if ratio == 4:
        prev = torch.cat([rows.new_zeros((1, 4, rows.shape[2])), rows], 0)[:n]
        kv = torch.cat([prev[..., :d], rows[..., d : 2 * d]], 1)
        sc = torch.cat([prev[..., 2 * d : 3 * d], rows[..., 3 * d :]], 1)
        sc[:1, :4] = -FLT_MAX
    else:
        kv, sc = rows[..., :d], rows[..., d:]
    return (torch.softmax(sc + ape.float(), dim=1) * kv).sum(1)


class DSV4Compressor(torch.nn.Module):
    """One DeepSeek-V4 compressor (an attention layer's, D = 512, or the indexer's, D = 128).

    | parameter | shape | dtype |
    |---|---|---|
    | wkv_gate | [2*coff*D, hidden] | `dtype` (bf16 by default); rows = [wkv ; wgate] |
    | ape | [ratio, coff*D] | fp32 (checkpoint layout) |
    | norm_weight | [D] | fp32 |

    with coff = 2 for c4 (overlap) and 1 for c128. Every combination of `head_dim` (D) in {128, 512} and `ratio`
    in {4, 128} (`custom_ops.dsv4.common.RATIOS`) is valid; other values raise `ValueError` here, naming the
    argument. `online=True` (c128, D = 512 or 128) keeps one running softmax state per request instead of raw rows.
    `state_dtype` (offline only) is fp32 or bf16.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int = 512,
        ratio: int = 4,
        *,
        online: bool = False,
        state_dtype: torch.dtype = torch.float32,
        norm_eps: float = 1e-6,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(
                f"head_dim: expected one of {HEAD_DIMS} (512: an attention layer's compressor, 128: the indexer's), "
                f"got {head_dim!r}"
            )
        check_ratio(ratio)
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype: expected one of {STATE_DTYPES}, got {state_dtype!r}")
        if online and (ratio != 128 or state_dtype != torch.float32):
            raise ValueError("online: needs ratio 128 and an fp32 state")
        self.ratio, self.head_dim, self.online = ratio, head_dim, online
        self.state_dtype, self.norm_eps = state_dtype, norm_eps
        coff = 2 if ratio == 4 else 1
        self.wkv_gate = torch.nn.Parameter(torch.empty(2 * coff * head_dim, hidden_size, dtype=dtype, device=device))
        self.ape = torch.nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32, device=device))
        self.norm_weight = torch.nn.Parameter(torch.ones(head_dim, dtype=torch.float32, device=device))
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random init (for examples and tests; real use loads a checkpoint)."""
        with torch.no_grad():
            std = self.wkv_gate.shape[1] ** -0.5
            w = torch.randn(self.wkv_gate.shape, generator=generator) * std
            self.wkv_gate.copy_(w)
            self.ape.copy_(torch.randn(self.ape.shape, generator=generator))
            self.norm_weight.fill_(1.0)

    @property
    def window(self) -> int:
        return window_of(self.ratio)

    @property
    def state_width(self) -> int:
        """Columns of one state row: raw rows (4D for c4, 2D for c128) or (m, l, a) = 3D when online."""
        if self.online:
            return 3 * self.head_dim
        return (4 if self.ratio == 4 else 2) * self.head_dim

    def kernel_ape(self) -> torch.Tensor:
        return kernel_ape(self.ape.detach(), self.ratio)

    def kv_score(self, x: torch.Tensor) -> torch.Tensor:
        """Projection `[T, hidden] -> fp32 [T, 2*coff*D]` (inputs rounded to the weight dtype, fp32 accumulate)."""
        w = self.wkv_gate.detach()
        return torch.nn.functional.linear(x.to(w.dtype).float(), w.float())

    def new_state(
        self, num_requests: int = 0, *, num_rows: int | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """A cleared state buffer: one ring of `window` rows per request slot (ring addressing), or `num_rows`
        rows (paged addressing: `(swa_pool_size // swa_page_size) * window`). Online: one row per request."""
        per_request = 1 if self.online else self.window
        rows = num_rows if num_rows is not None else num_requests * per_request
        device = device if device is not None else self.ape.device
        if self.online:
            state = torch.zeros(rows, self.state_width, device=device)
            state[:, : self.head_dim] = -torch.inf
            return state
        state = torch.zeros(rows, self.state_width, dtype=self.state_dtype, device=device)
        if self.ratio == 4:
            state[:, 2 * self.head_dim :] = -torch.inf
        else:
            state[:, self.head_dim :] = -torch.inf
        return state

    def forward(
        self,
        x: torch.Tensor,
        state: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        extend_lens: torch.Tensor | None = None,
        addressing: PagedAddressing | None = None,
    ) -> CompressOutput:
        """Compress one step; `extend_lens=None` means decode (one row of `x` per request).

        | arg | shape | dtype | notes |
        |---|---|---|---|
        | x | [N, hidden] | any float | hidden states (ragged for prefill/extend) |
        | state | see `new_state` | fp32/bf16 | mutated |
        | seq_lens | [B] | int32/int64 | lengths after this step |
        | req_pool_indices | [B] | int32/int64 | request slot; negative = padded row |
        | extend_lens | [B] or None | int32/int64 | new tokens per request (prefill/extend) |
        | addressing | PagedAddressing or None | | offline only; None = one ring per request |
        """
        return self.compress_scores(self.kv_score(x), state, seq_lens, req_pool_indices, extend_lens, addressing)

    def compress_scores(
        self,
        kv_score: torch.Tensor,
        state: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        extend_lens: torch.Tensor | None = None,
        addressing: PagedAddressing | None = None,
    ) -> CompressOutput:
        """`forward` from precomputed projection rows `kv_score [N, 2*coff*D]`."""
        if self.online and addressing is not None:
            raise ValueError("addressing: online c128 uses one state slot per request (req_pool_indices)")
        if addressing is None:
            req_pool_indices = self._own_requests(state, req_pool_indices)
        paged = (addressing.req_to_token, addressing.full_to_state) if addressing else (None, None)
        swa = addressing.swa_page_size if addressing else 0
        ape = self.kernel_ape()
        r = self.ratio
        n = kv_score.shape[0]
        state_rows = state.shape[0]
        if extend_lens is None:
            if self.online:
                plan = plan_online_decode(seq_lens, req_pool_indices)
                entries = online_compress_decode(state, kv_score, ape, plan)
                problems = online_decode_plan_problems(plan, state_rows)
            else:
                plan = plan_decode(seq_lens, req_pool_indices, *paged, r, self.window, swa)
                entries = compress_decode(state, kv_score, ape, plan, r)
                problems = decode_plan_problems(plan, state_rows, r)
            rows = read_decode_plan(plan)
            valid = decode_emits(rows, r)
            request = torch.arange(plan.shape[0], device=plan.device)
        else:
            if self.online:
                plan, plan_w = plan_online_prefill(seq_lens, extend_lens, req_pool_indices, n)
                entries = online_compress_prefill(state, kv_score, ape, plan, plan_w)
                problems = online_segment_problems("plan", plan, state_rows, n)
            else:
                plan, plan_w = plan_prefill(seq_lens, extend_lens, req_pool_indices, *paged, r, self.window, swa, n)
                entries = compress_prefill(state, kv_score, ape, plan, plan_w, r)
                problems = prefill_plan_problems(plan, plan_w, state_rows, n, r)
            rows = read_compress_plan(plan)
            valid = rows.valid
            ends = torch.cumsum(extend_lens.long(), 0)
            request = torch.searchsorted(ends, rows.ragged_id, right=True)
        # rows the CUDA kernels skip (the CPU ops raised for them above): no entry
        plan_name = "plan_c" if extend_lens is not None and not self.online else "plan"
        valid = valid & ~skipped_rows(problems, plan_name, plan.shape[0], plan.device)
        request = torch.where(valid, request, -1)
        window = torch.where(valid, rows.seq_len // r - 1, -1)
        return CompressOutput(entries, plan, valid, request, window, extend_lens is None, n)

    def _own_requests(self, state: torch.Tensor, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Ring and online addressing: every request id must own a ring (a slot) inside `state`. On CPU (and on
        CUDA in checking mode) an id past it raises; on CUDA (no host sync) it becomes a padding id (-1), so the
        request plans no rows: nothing of it is read, computed, written or stored, and its rows are invalid. Paged
        addressing has no per-request rows: its request ids are checked by the planner against `req_to_token`."""
        check_tensor("state", state, STATE_DTYPES)
        check_index("req_pool_indices", req_pool_indices, 1)
        per_request = 1 if self.online else self.window
        capacity = state.shape[0] // per_request
        if must_check_values(req_pool_indices):
            what = f"expected < {capacity} (requests of state: {state.shape[0]} rows, {per_request} per request)"
            if torch.compiler.is_compiling():  # no value to read while tracing: the graph checks when it runs
                inside = (req_pool_indices < capacity).all()
                torch._assert_async(inside, f"req_pool_indices: an entry is out of range: {what}")
            else:
                check_index_range("req_pool_indices", req_pool_indices, capacity, what)
        return torch.where(req_pool_indices < capacity, req_pool_indices, -1)

    def store(
        self,
        out: CompressOutput,
        freqs: torch.Tensor,
        out_loc: torch.Tensor,
        kvcache: torch.Tensor,
        page_size: int,
        fp4: bool = False,
    ) -> None:
        """RMSNorm -> RoPE -> FP8 (or FP4) store of `out`'s entries into `kvcache` (`dsv4_compress_norm_rope_store`).

        `out_loc`: cache slot per query token (prefill/extend) or per request (decode), `out.tokens` entries (a
        `ValueError` otherwise, on every device); negative skips. `kvcache`: FlashMLA V4 layout for head_dim 512,
        indexer FP8 (or with `fp4`, FP4) layout for 128 (`cache_page_bytes`). Only the rows of `out.valid` are
        stored: the others go to the op as padding plan rows.
        """
        check_index("out_loc", out_loc, 1)
        if out_loc.shape[0] != out.tokens:
            per = "request" if out.decode else "query token"
            raise ValueError(f"out_loc: expected {out.tokens} entries (one per {per}), got {out_loc.shape[0]}")
        invalid = DECODE_INVALID if out.decode else COMPRESS_INVALID
        fields = out.plan.view(torch.int32)  # [rows, 4]; built from scalars on the device: no host copy
        plan = torch.stack([torch.where(out.valid, fields[:, i], v) for i, v in enumerate(invalid)], 1)
        plan = plan.view(torch.uint8)
        weight = self.norm_weight.detach().float()
        compress_norm_rope_store(
            out.entries,
            plan,
            weight,
            self.norm_eps,
            freqs,
            out_loc,
            kvcache,
            page_size,
            self.ratio,
            out.decode,
            fp4,
        )
