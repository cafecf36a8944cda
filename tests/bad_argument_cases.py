"""The bad-argument table of every `dspark` op (`BAD_ARGUMENT_CASES`), run by tests/test_error_agreement.py.

Every op validates its arguments twice: in Python (the CPU impl and the fake impl) and in C++ (the CUDA binding in
custom_ops/csrc/*.cu). An entry (`BadCase`) builds valid CPU arguments of its op with one thing broken and says
which error class both checks raise and which argument the message names (`argument_named`). A tensor on the meta
device stands for "a tensor on another device than the others": such device-mismatch entries only run on CUDA,
where that tensor goes to the CPU and every other tensor to the GPU.

A rule that only one side checks is an entry too, with `only` saying which side has it ("cuda": only the C++
binding, "python": only the Python check) and `reason` where (file:line); the agreement test marks it
`xfail(strict=True)`, so it shows up until both sides agree.

The entries come from the tables of the op families, adapted here (`flashmla_cases.structural_cases`,
`dsv4_cases.DECODE_BAD_STRUCTURE`, `multi_linear_cases.MULTI_LINEAR_BAD_INPUTS`, `multi_linear_cases.BAD_CASES`,
`multi_linear_cases.CUDA_ONLY_CASES`; their own tests keep using them), and from the lists below.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from dsv4_cases import (
    DECODE_BAD_STRUCTURE,
    INVALID_C,
    INVALID_D,
    STORE_FREQS,
    STORE_PAGE,
    corruption_case,
    decode_args,
    store_case,
    storing_rows,
)
from flashmla_cases import HEADS, inside, offset_copy, structural_cases
from flashmla_cases import _inputs as flashmla_inputs
from multi_linear_cases import (
    BAD,
    BAD_CASES,
    CUDA_ONLY_CASES,
    MULTI_LINEAR_BAD_INPUTS,
    make_case,
    multi_linear_bad_args,
)

import custom_ops
from custom_ops.dsv4.plan import plan_decode, plan_online_decode, plan_online_prefill, plan_prefill
from custom_ops.dsv4.store import cache_page_bytes

ops = torch.ops.dspark


# ---------------------------------------------------------------------------------------------- the namespace


def dspark_ops() -> list[str]:
    """Every public op of the `dspark` namespace (from the dispatcher, so an op added anywhere is listed). The debug
    ops (a leading underscore: `_multi_linear_variant`, `_multi_linear_cublas`) force a CUDA path of `multi_linear`
    for the benchmarks and tests; CUDA only, with no Python side to agree with, they are not in the table."""
    names = (n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dspark::"))
    return sorted(n for n in names if not n.startswith("_"))


def op_parameters(op: str) -> list[str]:
    """The argument names of `op`'s schema, in order."""
    return [a.name for a in getattr(ops, op).default._schema.arguments]


@functools.cache
def _all_parameters() -> frozenset[str]:
    return frozenset(name for op in dspark_ops() for name in op_parameters(op))


@functools.cache
def _op_names() -> frozenset[str]:
    return frozenset(dspark_ops())


_WORD = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(\[\d+\])?")


def argument_named(message: str) -> str:
    """The argument an error message names: every message of a `dspark` op starts with it.

    Rule: take the message's first line; drop a leading `<op>: ` prefix (`<op>` an op of the namespace: the
    multi_linear* messages); the argument is the first word if it is a parameter name of a `dspark` op, with its
    `[i]` subscript if it has one (`weights[1]`, `k_row_starts[1] = -1: rows ...`), and the first of several joined
    by `/` (`req_to_token/full_to_state: pass both ...` names `req_to_token`). "" when the message does not start
    with a parameter name."""
    text = message.splitlines()[0] if message else ""
    prefix, sep, rest = text.partition(": ")
    if sep and prefix in _op_names():
        text = rest
    m = _WORD.match(text)
    return m.group(0) if m is not None and m.group(1) in _all_parameters() else ""


def _first_word(pattern: str) -> str:
    """The first word of a message regex of the family tables, unescaped (`k_caches\\[0\\]` -> `k_caches[0]`)."""
    return re.sub(r"\\(.)", r"\1", pattern.strip().split(" ")[0]).rstrip(":")


# ---------------------------------------------------------------------------------------------- the entry


@dataclass(frozen=True)
class BadCase:
    """One bad call: `make_args()` gives fresh valid CPU arguments of `op` (a dict by argument name) with one thing
    broken; both checks raise `error` naming `arg` (as `argument_named` reads it). `only="cuda"`: a documented
    requirement of the CUDA kernels alone (`reason` says where), which the CPU impl and the fake accept; None for a
    rule both sides check."""

    op: str
    case_id: str
    make_args: Callable[[], dict]
    error: type[Exception]
    arg: str
    only: str | None = None
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.op}: {self.case_id}"


def _meta(t: torch.Tensor) -> torch.Tensor:
    """`t` on another device than the other arguments (CUDA runs put it on the CPU)."""
    return t.to("meta")


# ---------------------------------------------------------------------------------------------- valid arguments


def _plan_decode(paged: bool = False) -> dict:
    """Ring addressing (c4, rings of 8): two requests, a padding row, request 1; paged: a [3, 16] token table."""
    args = dict(
        seq_lens=torch.tensor([5, 9, 0, 12]),
        req_pool_indices=torch.tensor([0, 2, -1, 1]),
        req_to_token=None,
        full_to_state=None,
        ratio=4,
        ring_size=8,
        swa_page_size=0,
    )
    if paged:
        args.update(req_to_token=torch.arange(48).view(3, 16), full_to_state=torch.arange(48), swa_page_size=16)
    return args


def _plan_prefill(paged: bool = False) -> dict:
    args = _plan_decode(paged)
    return dict(
        seq_lens=torch.tensor([5, 9, 12]),
        extend_lens=torch.tensor([3, 9, 2]),
        req_pool_indices=torch.tensor([0, 2, 1]),
        req_to_token=args["req_to_token"],
        full_to_state=args["full_to_state"],
        ratio=4,
        ring_size=8,
        swa_page_size=args["swa_page_size"],
        num_q_tokens=14,
    )


def _plan_online_decode() -> dict:
    return dict(seq_lens=torch.tensor([1, 130, 0]), req_pool_indices=torch.tensor([0, 1, -1]))


def _plan_online_prefill() -> dict:
    return dict(
        seq_lens=torch.tensor([130, 5]),
        extend_lens=torch.tensor([3, 5]),
        req_pool_indices=torch.tensor([1, 0]),
        num_q_tokens=8,
    )


def _compress(ratio: int, online: bool, decode: bool) -> dict:
    """`dsv4_cases.corruption_case` (head dim 128, valid plans of 3-4 requests) as the op's arguments."""
    state, kv, ape, plans = corruption_case(ratio, online, decode, torch.Generator().manual_seed(0))
    args = dict(state=state, kv_score=kv, ape=ape)
    args.update(dict(plan=plans[0]) if decode else dict(plan_c=plans[0], plan_w=plans[1]))
    if not online:
        args["ratio"] = ratio
    return args


def _store() -> dict:
    """`dsv4_cases.store_case`: 24 decode entries of head dim 128 (FP8 indexer cache, pages of 16), ratio 4."""
    kv, plan, w, out_loc, cache = store_case(128, False, True)
    return dict(
        kv=kv,
        plan=plan,
        norm_weight=w,
        eps=1e-6,
        freqs=STORE_FREQS,
        out_loc=out_loc,
        kvcache=cache,
        page_size=STORE_PAGE,
        ratio=4,
        decode=True,
        fp4=False,
    )


def _store_prefill() -> dict:
    """One c4 request of 8 tokens (windows at tokens 3 and 7) on a FlashMLA cache (head dim 512): the plan has 3 rows
    (2 entries and a padding row), `out_loc` one entry per query token."""
    g = torch.Generator().manual_seed(8)
    plan, _ = plan_prefill(torch.tensor([8]), torch.tensor([8]), torch.tensor([0]), None, None, 4, 8, 0, 8)
    args = _store()
    args.update(
        kv=torch.randn(plan.shape[0], 512, generator=g),
        plan=plan,
        norm_weight=torch.rand(512, generator=g) + 0.5,
        out_loc=torch.randperm(4 * STORE_PAGE, generator=g)[:8],
        kvcache=torch.randint(0, 256, (4, cache_page_bytes(512, STORE_PAGE)), dtype=torch.uint8, generator=g),
        decode=False,
    )
    return args


_MULTI_LINEAR = ("x", "weights", "row_starts", "row_counts", "biases")


def _multi_linear(mutate=lambda a: None) -> dict:
    return dict(zip(_MULTI_LINEAR, multi_linear_bad_args(mutate), strict=True))


_FLASHMLA = (
    "fused_k_norm_rope_flashmla",
    "fused_q_norm_rope",
    "fused_norm_rope_inplace",
    "store_flashmla_cache",
    "fused_q_indexer_rope_hadamard_quant",
)


VALID_ARGS: dict[str, Callable[[], dict]] = {
    "dsv4_plan_decode": _plan_decode,
    "dsv4_plan_prefill": _plan_prefill,
    "dsv4_plan_online_decode": _plan_online_decode,
    "dsv4_plan_online_prefill": _plan_online_prefill,
    "dsv4_compress_decode": decode_args,
    "dsv4_compress_prefill": lambda: _compress(4, False, False),
    "dsv4_online_compress_decode": lambda: _compress(128, True, True),
    "dsv4_online_compress_prefill": lambda: _compress(128, True, False),
    "dsv4_compress_norm_rope_store": _store,
    **{op: functools.partial(flashmla_inputs, op) for op in _FLASHMLA},
    "multi_linear": _multi_linear,
    "multi_linear_kv_write": lambda: make_case(BAD).args,
}
"""Valid CPU arguments of every op: the base the entries break one thing of."""


def _case(op, case_id, change, error, arg, only=None, reason="", build=None) -> BadCase:
    """An entry whose arguments are `build()` (default: `VALID_ARGS[op]()`) updated with `change(args)`."""
    base = build or VALID_ARGS[op]

    def make_args() -> dict:
        args = base()
        args.update(change(args))
        return args

    return BadCase(op, case_id, make_args, error, arg, only, reason)


# ---------------------------------------------------------------------------------------------- CUDA-only rules
#
# Requirements of the CUDA kernels alone, documented as such (docs/ops.md, multi_linear_kv_write): the CPU impl and
# the fake impl accept these inputs, the CUDA binding raises naming the argument.

_KV_WRITE_CUDA_ONLY = "a requirement of the CUDA kernels (docs/ops.md: multi_linear_kv_write, CUDA)"


# ---------------------------------------------------------------------------------------------- planners


def _planner_cases() -> list[BadCase]:
    paged_decode = functools.partial(_plan_decode, True)
    paged_prefill = functools.partial(_plan_prefill, True)
    d, p, od, op_ = "dsv4_plan_decode", "dsv4_plan_prefill", "dsv4_plan_online_decode", "dsv4_plan_online_prefill"
    return [
        _case(d, "seq_lens float", lambda a: {"seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens"),
        _case(d, "seq_lens 2-D", lambda a: {"seq_lens": a["seq_lens"][:, None]}, ValueError, "seq_lens"),
        _case(
            d,
            "req_pool_indices int16",
            lambda a: {"req_pool_indices": a["req_pool_indices"].to(torch.int16)},
            TypeError,
            "req_pool_indices",
        ),
        _case(
            d,
            "req_pool_indices length",
            lambda a: {"req_pool_indices": a["req_pool_indices"][:3]},
            ValueError,
            "req_pool_indices",
        ),
        _case(
            d,
            "req_pool_indices device",
            lambda a: {"req_pool_indices": _meta(a["req_pool_indices"])},
            ValueError,
            "req_pool_indices",
        ),
        _case(d, "ratio 8", lambda a: {"ratio": 8}, ValueError, "ratio"),
        _case(d, "ring_size below the window", lambda a: {"ring_size": 4}, ValueError, "ring_size"),
        _case(d, "ring_size not a multiple of ratio", lambda a: {"ring_size": 10}, ValueError, "ring_size"),
        _case(
            d,
            "req_to_token without full_to_state",
            lambda a: {"full_to_state": None},
            ValueError,
            "req_to_token",
            build=paged_decode,
        ),
        _case(
            d,
            "req_to_token 1-D",
            lambda a: {"req_to_token": a["req_to_token"].reshape(-1)},
            ValueError,
            "req_to_token",
            build=paged_decode,
        ),
        _case(
            d,
            "full_to_state float",
            lambda a: {"full_to_state": a["full_to_state"].float()},
            TypeError,
            "full_to_state",
            build=paged_decode,
        ),
        _case(
            d,
            "full_to_state device",
            lambda a: {"full_to_state": _meta(a["full_to_state"])},
            ValueError,
            "full_to_state",
            build=paged_decode,
        ),
        _case(d, "swa_page_size 0", lambda a: {"swa_page_size": 0}, ValueError, "swa_page_size", build=paged_decode),
        _case(
            d,
            "swa_page_size not a multiple of ring_size",
            lambda a: {"swa_page_size": 12},
            ValueError,
            "swa_page_size",
            build=paged_decode,
        ),
        _case(p, "seq_lens int16", lambda a: {"seq_lens": a["seq_lens"].to(torch.int16)}, TypeError, "seq_lens"),
        _case(p, "extend_lens float", lambda a: {"extend_lens": a["extend_lens"].float()}, TypeError, "extend_lens"),
        _case(p, "extend_lens length", lambda a: {"extend_lens": a["extend_lens"][:2]}, ValueError, "extend_lens"),
        _case(p, "extend_lens device", lambda a: {"extend_lens": _meta(a["extend_lens"])}, ValueError, "extend_lens"),
        _case(p, "num_q_tokens negative", lambda a: {"num_q_tokens": -1}, ValueError, "num_q_tokens"),
        _case(p, "num_q_tokens above 65535", lambda a: {"num_q_tokens": 65536}, ValueError, "num_q_tokens"),
        _case(p, "ratio 0", lambda a: {"ratio": 0}, ValueError, "ratio"),
        _case(p, "ring_size above int32", lambda a: {"ring_size": 2**31}, ValueError, "ring_size"),
        _case(
            p,
            "full_to_state without req_to_token",
            lambda a: {"req_to_token": None},
            ValueError,
            "req_to_token",
            build=paged_prefill,
        ),
        _case(
            p,
            "req_to_token int16",
            lambda a: {"req_to_token": a["req_to_token"].to(torch.int16)},
            TypeError,
            "req_to_token",
            build=paged_prefill,
        ),
        _case(
            p,
            "swa_page_size above int32",
            lambda a: {"swa_page_size": 2**31},
            ValueError,
            "swa_page_size",
            build=paged_prefill,
        ),
        _case(od, "seq_lens bool", lambda a: {"seq_lens": a["seq_lens"] > 0}, TypeError, "seq_lens"),
        _case(od, "seq_lens 0-D", lambda a: {"seq_lens": a["seq_lens"][0]}, ValueError, "seq_lens"),
        _case(
            od,
            "req_pool_indices fp64",
            lambda a: {"req_pool_indices": a["req_pool_indices"].double()},
            TypeError,
            "req_pool_indices",
        ),
        _case(
            od,
            "req_pool_indices longer",
            lambda a: {"req_pool_indices": torch.arange(4)},
            ValueError,
            "req_pool_indices",
        ),
        _case(
            od,
            "req_pool_indices 2-D",
            lambda a: {"req_pool_indices": a["req_pool_indices"][None]},
            ValueError,
            "req_pool_indices",
        ),
        _case(
            od,
            "req_pool_indices device",
            lambda a: {"req_pool_indices": _meta(a["req_pool_indices"])},
            ValueError,
            "req_pool_indices",
        ),
        _case(op_, "seq_lens float", lambda a: {"seq_lens": a["seq_lens"].float()}, TypeError, "seq_lens"),
        _case(
            op_,
            "extend_lens int8",
            lambda a: {"extend_lens": a["extend_lens"].to(torch.int8)},
            TypeError,
            "extend_lens",
        ),
        _case(op_, "extend_lens 2-D", lambda a: {"extend_lens": a["extend_lens"][:, None]}, ValueError, "extend_lens"),
        _case(
            op_,
            "extend_lens device",
            lambda a: {"extend_lens": _meta(a["extend_lens"])},
            ValueError,
            "extend_lens",
        ),
        _case(
            op_,
            "req_pool_indices length",
            lambda a: {"req_pool_indices": a["req_pool_indices"][:1]},
            ValueError,
            "req_pool_indices",
        ),
        _case(op_, "num_q_tokens 70000", lambda a: {"num_q_tokens": 70000}, ValueError, "num_q_tokens"),
    ]


# ---------------------------------------------------------------------------------------------- compress, store


def _wide(t: torch.Tensor, extra: int) -> torch.Tensor:
    """`t`'s values in the first columns of a wider tensor: same shape, not contiguous, unit inner stride."""
    buf = torch.zeros(t.shape[0], t.shape[1] + extra, dtype=t.dtype)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def _inner_strided(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values with an inner stride of 2."""
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def _shared_memory_cases() -> list[BadCase]:
    """An input in the bytes of the tensor the op writes: each op raises naming the written tensor."""
    return [
        _case(op, f"{inp} inside {out}", lambda a, o=out, i=inp: {i: inside(a[o], a[i])}, ValueError, out)
        for op, out, inp in [
            ("dsv4_compress_decode", "state", "ape"),
            ("dsv4_compress_prefill", "state", "plan_w"),
            ("dsv4_online_compress_decode", "state", "plan"),
            ("dsv4_online_compress_prefill", "state", "plan_c"),
            ("dsv4_compress_norm_rope_store", "kvcache", "kv"),
        ]
    ]


def _decode_structure_cases() -> list[BadCase]:
    def adapt(change):
        return lambda a: (change(a), {})[1]

    return [
        _case("dsv4_compress_decode", case_id, adapt(change), error, arg)
        for case_id, change, error, arg in DECODE_BAD_STRUCTURE
    ]


def _compress_cases() -> list[BadCase]:
    cd, cp = "dsv4_compress_decode", "dsv4_compress_prefill"
    od, op_ = "dsv4_online_compress_decode", "dsv4_online_compress_prefill"
    c128 = functools.partial(_compress, 128, False, False)
    return [
        *_decode_structure_cases(),
        *_shared_memory_cases(),
        _case(
            cd, "kv_score inner stride 2", lambda a: {"kv_score": _inner_strided(a["kv_score"])}, ValueError, "kv_score"
        ),
        _case(cd, "state not contiguous", lambda a: {"state": _wide(a["state"], 16)}, ValueError, "state"),
        _case(cd, "kv_score device", lambda a: {"kv_score": _meta(a["kv_score"])}, ValueError, "kv_score"),
        _case(
            cd,
            "ape misaligned",
            lambda a: {"ape": offset_copy(a["ape"], 1)},
            ValueError,
            "ape",
        ),
        _case(
            cd,
            "plan misaligned",
            lambda a: {"plan": offset_copy(a["plan"], 4)},
            ValueError,
            "plan",
        ),
        _case(cp, "ratio 3", lambda a: {"ratio": 3}, ValueError, "ratio"),
        _case(cp, "state fp16", lambda a: {"state": a["state"].half()}, TypeError, "state"),
        _case(cp, "state rows", lambda a: {"state": a["state"][:-2]}, ValueError, "state"),
        _case(cp, "kv_score width", lambda a: {"kv_score": a["kv_score"][:, :256]}, ValueError, "kv_score"),
        _case(cp, "ape head dim 64", lambda a: {"ape": a["ape"][:, :64].contiguous()}, ValueError, "ape"),
        _case(cp, "plan_c int32", lambda a: {"plan_c": a["plan_c"].view(torch.int32)}, TypeError, "plan_c"),
        _case(cp, "plan_c not contiguous", lambda a: {"plan_c": _wide(a["plan_c"], 16)}, ValueError, "plan_c"),
        _case(cp, "plan_w width 16", lambda a: {"plan_w": a["plan_c"].clone()}, ValueError, "plan_w"),
        _case(cp, "plan_w 1-D", lambda a: {"plan_w": a["plan_w"].reshape(-1)}, ValueError, "plan_w"),
        _case(cp, "plan_w device", lambda a: {"plan_w": _meta(a["plan_w"])}, ValueError, "plan_w"),
        _case(cp, "c128 ape rows", lambda a: {"ape": a["ape"][:8]}, ValueError, "ape", build=c128),
        _case(cp, "c128 state width", lambda a: {"state": a["state"][:, :128]}, ValueError, "state", build=c128),
        _case(
            cp,
            "plan_c misaligned",
            lambda a: {"plan_c": offset_copy(a["plan_c"], 8)},
            ValueError,
            "plan_c",
        ),
        _case(od, "state bf16", lambda a: {"state": a["state"].bfloat16()}, TypeError, "state"),
        _case(od, "state width 2D", lambda a: {"state": a["state"][:, :256]}, ValueError, "state"),
        _case(od, "state not contiguous", lambda a: {"state": _wide(a["state"], 16)}, ValueError, "state"),
        _case(od, "kv_score width 3D", lambda a: {"kv_score": torch.zeros(4, 384)}, ValueError, "kv_score"),
        _case(od, "kv_score fp64", lambda a: {"kv_score": a["kv_score"].double()}, TypeError, "kv_score"),
        _case(od, "ape 64 rows", lambda a: {"ape": a["ape"][:64]}, ValueError, "ape"),
        _case(od, "plan rows", lambda a: {"plan": a["plan"][:3]}, ValueError, "plan"),
        _case(od, "plan width 8", lambda a: {"plan": a["plan"][:, :8].contiguous()}, ValueError, "plan"),
        _case(od, "ape device", lambda a: {"ape": _meta(a["ape"])}, ValueError, "ape"),
        _case(
            od,
            "ape misaligned",
            lambda a: {"ape": offset_copy(a["ape"], 2)},
            ValueError,
            "ape",
        ),
        _case(op_, "state fp64", lambda a: {"state": a["state"].double()}, TypeError, "state"),
        _case(op_, "kv_score fp16", lambda a: {"kv_score": a["kv_score"].half()}, TypeError, "kv_score"),
        _case(op_, "ape head dim 256", lambda a: {"ape": torch.zeros(128, 256)}, ValueError, "ape"),
        _case(op_, "plan_c int16", lambda a: {"plan_c": a["plan_c"].view(torch.int16)}, TypeError, "plan_c"),
        _case(op_, "plan_w width 8", lambda a: {"plan_w": a["plan_w"][:, :8].contiguous()}, ValueError, "plan_w"),
        _case(op_, "plan_c device", lambda a: {"plan_c": _meta(a["plan_c"])}, ValueError, "plan_c"),
        _case(
            op_,
            "plan_w misaligned",
            lambda a: {"plan_w": offset_copy(a["plan_w"], 8)},
            ValueError,
            "plan_w",
        ),
    ]


def _store_cases() -> list[BadCase]:
    s = "dsv4_compress_norm_rope_store"

    def misaligned(name, elements):
        return _case(
            s,
            f"{name} misaligned",
            lambda a: {name: offset_copy(a[name], elements)},
            ValueError,
            name,
        )

    return [
        _case(s, "ratio 2", lambda a: {"ratio": 2}, ValueError, "ratio"),
        _case(s, "kv fp64", lambda a: {"kv": a["kv"].double()}, TypeError, "kv"),
        _case(s, "kv width 64", lambda a: {"kv": a["kv"][:, :64]}, ValueError, "kv"),
        _case(s, "kv not contiguous", lambda a: {"kv": a["kv"].t().contiguous().t()}, ValueError, "kv"),
        _case(s, "fp4 with head dim 512", lambda a: {"kv": torch.zeros(24, 512), "fp4": True}, ValueError, "fp4"),
        _case(s, "plan int32", lambda a: {"plan": a["plan"].view(torch.int32)}, TypeError, "plan"),
        _case(s, "plan rows", lambda a: {"plan": a["plan"][:-1]}, ValueError, "plan"),
        _case(s, "plan width 8", lambda a: {"plan": a["plan"][:, :8].contiguous()}, ValueError, "plan"),
        _case(s, "norm_weight fp16", lambda a: {"norm_weight": a["norm_weight"].half()}, TypeError, "norm_weight"),
        _case(s, "norm_weight length", lambda a: {"norm_weight": a["norm_weight"][:64]}, ValueError, "norm_weight"),
        _case(s, "eps nan", lambda a: {"eps": float("nan")}, ValueError, "eps"),
        _case(s, "eps negative", lambda a: {"eps": -1e-6}, ValueError, "eps"),
        _case(s, "freqs fp64", lambda a: {"freqs": a["freqs"].double()}, TypeError, "freqs"),
        _case(s, "freqs width 32", lambda a: {"freqs": a["freqs"][:, :32].contiguous()}, ValueError, "freqs"),
        _case(s, "out_loc float", lambda a: {"out_loc": a["out_loc"].float()}, TypeError, "out_loc"),
        _case(s, "out_loc 2-D", lambda a: {"out_loc": a["out_loc"][:, None]}, ValueError, "out_loc"),
        _case(s, "out_loc length for decode", lambda a: {"out_loc": a["out_loc"][:-1]}, ValueError, "out_loc"),
        _case(s, "page_size 24", lambda a: {"page_size": 24}, ValueError, "page_size"),
        _case(s, "page_size 0", lambda a: {"page_size": 0}, ValueError, "page_size"),
        _case(s, "kvcache int8", lambda a: {"kvcache": a["kvcache"].to(torch.int8)}, TypeError, "kvcache"),
        _case(s, "kvcache width", lambda a: {"kvcache": a["kvcache"][:, : 68 * STORE_PAGE]}, ValueError, "kvcache"),
        _case(s, "kvcache not contiguous", lambda a: {"kvcache": _wide(a["kvcache"], 64)}, ValueError, "kvcache"),
        _case(s, "norm_weight device", lambda a: {"norm_weight": _meta(a["norm_weight"])}, ValueError, "norm_weight"),
        _case(s, "kvcache device", lambda a: {"kvcache": _meta(a["kvcache"])}, ValueError, "kvcache"),
        misaligned("kv", 1),
        misaligned("norm_weight", 2),
        misaligned("freqs", 1),
        misaligned("plan", 4),
        misaligned("kvcache", 1),
    ]


# ---------------------------------------------------------------------------------------------- row lengths
#
# Every per-row argument of every DeepSeek-V4 op, one entry short and one long (where a longer one is an error), on
# every path: per-request tensors against `seq_lens` (planners: ring, paged, online; decode and prefill), plans
# against `kv_score` (decode compress ops: c4, c128, online), plans and `out_loc` against `kv` (store: decode and
# prefill). A prefill `out_loc` has one entry per query token, so a longer one is valid; the prefill compress ops'
# plans have no length tied to `kv_score` (their ragged ids are values: `SKIPPED_VALUE_CASES`).


def _shorter(t: torch.Tensor) -> torch.Tensor:
    return t[:-1]


def _longer(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t[-1:]])


def _row_length_cases() -> list[BadCase]:
    planners = {
        "dsv4_plan_decode": [("ring", _plan_decode), ("paged", functools.partial(_plan_decode, True))],
        "dsv4_plan_prefill": [("ring", _plan_prefill), ("paged", functools.partial(_plan_prefill, True))],
        "dsv4_plan_online_decode": [("online", _plan_online_decode)],
        "dsv4_plan_online_prefill": [("online", _plan_online_prefill)],
    }
    compress = {
        "dsv4_compress_decode": [("c4", decode_args), ("c128", functools.partial(decode_args, 128))],
        "dsv4_online_compress_decode": [("online", VALID_ARGS["dsv4_online_compress_decode"])],
    }
    store = [("decode", _store), ("prefill", _store_prefill)]
    rows: list[tuple[str, str, Callable[[], dict], str]] = []  # (op, path, build, argument)
    for op, paths in planners.items():
        per_request = [n for n in ("req_pool_indices", "extend_lens") if n in op_parameters(op)]
        rows += [(op, path, build, name) for path, build in paths for name in per_request]
    rows += [(op, path, build, name) for op, paths in compress.items() for path, build in paths for name in ("plan",)]
    rows += [(s, path, build, "plan") for s in ("dsv4_compress_norm_rope_store",) for path, build in store]
    cases = []
    for op, path, build, name in rows:
        for how, change in (("short", _shorter), ("long", _longer)):
            cases.append(
                _case(
                    op,
                    f"{name} {how} ({path})",
                    lambda a, n=name, c=change: {n: c(a[n])},
                    ValueError,
                    name,
                    build=build,
                )
            )
    s = "dsv4_compress_norm_rope_store"
    return [
        *cases,
        _case(s, "out_loc short (decode)", lambda a: {"out_loc": _shorter(a["out_loc"])}, ValueError, "out_loc"),
        _case(s, "out_loc long (decode)", lambda a: {"out_loc": _longer(a["out_loc"])}, ValueError, "out_loc"),
        _case(
            s,
            "out_loc shorter than the prefill plan",
            lambda a: {"out_loc": a["out_loc"][:2]},
            ValueError,
            "out_loc",
            build=_store_prefill,
        ),
    ]


# ---------------------------------------------------------------------------------------------- skipped values
#
# Value-level errors: index values that live on the device. CPU (and CUDA in checking mode) raises `ValueError`
# naming the value; CUDA without checking mode cannot (no host sync) and skips the affected rows, reporting them
# invalid: a planner writes the invalid pattern for them, a compress op a zero output row (and no state row), the
# store no cache byte. `make_neutral()` is the same call with those rows as padding (a -1 request id or slot, a
# padding plan row); the CUDA results on the bad arguments must equal the CPU results on the neutral ones.


@dataclass(frozen=True)
class SkipCase:
    """CPU raises `ValueError` naming `arg` for `make_args()`; CUDA skips the rows that `make_neutral()` pads."""

    op: str
    case_id: str
    make_args: Callable[[], dict]
    make_neutral: Callable[[], dict]
    arg: str

    @property
    def id(self) -> str:
        return f"{self.op}: {self.case_id}"


def _skip(op, case_id, build, bad, neutral, arg) -> SkipCase:
    """`build()` updated with `bad(args)` (the erroneous call) or with `neutral(args)` (its rows as padding)."""

    def make(change):
        def args() -> dict:
            a = build()
            a.update(change(a))
            return a

        return args

    return SkipCase(op, case_id, make(bad), make(neutral), arg)


def _set(name: str, i: int, value: int) -> Callable[[dict], dict]:
    def change(a: dict) -> dict:
        t = a[name].clone()
        t[i] = value
        return {name: t}

    return change


def _state_rows_as_padding(a: dict) -> dict:
    """The plans of a compress call with every row that addresses past the state replaced by padding (decode: rows
    that write past it; offline prefill: compress rows that read it and write rows; online: rows of a slot past
    it)."""
    rows = a["state"].shape[0]
    online = "ratio" not in a
    pages = rows if online else rows // a["ratio"]
    rules = {
        "plan": (INVALID_D, lambda w: w[:, 1] >= rows),
        "plan_c": (INVALID_C, lambda w: w[:, 2] >= rows if online else ((w[:, 1] >> 16) > 0) & (w[:, 3] >= pages)),
        "plan_w": (INVALID_C if online else [-1, -1], lambda w: w[:, 2 if online else 1] >= rows),
    }
    out = {}
    for name, (invalid, past) in rules.items():
        if name in a:
            words = a[name].clone().view(torch.int32)
            words[past(words)] = torch.tensor(invalid, dtype=torch.int32)
            out[name] = words.view(torch.uint8)
    return out


def _past_the_state(a: dict) -> dict:
    """The plans of the same call with request 1 (offline prefill: and 2) moved past the state."""
    rows = a["state"].shape[0]
    if "ratio" not in a:  # online: one slot per request
        seq, rid = (torch.tensor([128, 200, 256, 129]), torch.tensor([0, rows, 2, 3]))
        if "plan" in a:
            return {"plan": plan_online_decode(seq, rid)}
        seq, ext, rid = torch.tensor([300, 128, 5]), torch.tensor([200, 128, 1]), torch.tensor([0, rows, 2])
        plan_c, plan_w = plan_online_prefill(seq, ext, rid, a["kv_score"].shape[0])
        return {"plan_c": plan_c, "plan_w": plan_w}
    r = a["ratio"]
    ring = 8 if r == 4 else 128
    past = rows // ring
    if "plan" in a:
        return {"plan": plan_decode(torch.tensor([4, 9]), torch.tensor([0, past]), None, None, r, ring)}
    seq, ext = torch.tensor([2 * r + 3, 3 * r, r + 1]), torch.tensor([r + 5, 2 * r, 2])
    rid = torch.tensor([0, past, past + 1])  # c128: request 1's windows need no state row, request 2's does
    plan_c, plan_w = plan_prefill(seq, ext, rid, None, None, r, ring, 0, a["kv_score"].shape[0])
    return {"plan_c": plan_c, "plan_w": plan_w}


def _neutral_past_the_state(a: dict) -> dict:
    moved = dict(a)
    moved.update(_past_the_state(a))
    return _state_rows_as_padding(moved)


def _store_freqs_short(a: dict) -> dict:
    return {"freqs": a["freqs"][:100].contiguous()}


def _store_rows_past_freqs(a: dict) -> dict:
    """`_store_freqs_short` with the slots of the rows whose RoPE position is past the table set to -1."""
    rows, source = storing_rows(a["plan"], a["out_loc"], a["decode"])
    plan_seq = a["plan"].view(torch.int32)[:, 0].long() & 0xFFFFFFFF
    late = rows[plan_seq[rows] - 4 >= 100]
    out_loc = a["out_loc"].clone()
    out_loc[source[late]] = -1
    return {**_store_freqs_short(a), "out_loc": out_loc}


def _first_late_row(build: Callable[[], dict]) -> int:
    a = build()
    rows, _ = storing_rows(a["plan"], a["out_loc"], a["decode"])
    plan_seq = a["plan"].view(torch.int32)[:, 0].long() & 0xFFFFFFFF
    return int(rows[plan_seq[rows] - 4 >= 100][0])


def _skipped_value_cases() -> list[SkipCase]:
    cases = []
    ring_past, online_past = 2**31 // 8, 2**31
    planners = [
        ("dsv4_plan_decode", "ring", _plan_decode, ring_past),
        ("dsv4_plan_decode", "paged", functools.partial(_plan_decode, True), 3),
        ("dsv4_plan_prefill", "ring", _plan_prefill, ring_past),
        ("dsv4_plan_prefill", "paged", functools.partial(_plan_prefill, True), 3),
        ("dsv4_plan_online_decode", "online", _plan_online_decode, online_past),
        ("dsv4_plan_online_prefill", "online", _plan_online_prefill, online_past),
    ]
    for op, path, build, past in planners:
        rid = "req_pool_indices[1]"
        cases.append(
            _skip(op, f"{rid} past the requests ({path})", build, _set(rid[:-3], 1, past), _set(rid[:-3], 1, -1), rid)
        )
    compress = [
        ("dsv4_compress_decode", "c4", decode_args, "plan[1]"),
        ("dsv4_compress_decode", "c128", functools.partial(decode_args, 128), "plan[1]"),
        ("dsv4_compress_prefill", "c4", VALID_ARGS["dsv4_compress_prefill"], "plan_c[2]"),
        ("dsv4_compress_prefill", "c128", functools.partial(_compress, 128, False, False), "plan_c[4]"),
        ("dsv4_online_compress_decode", "online", VALID_ARGS["dsv4_online_compress_decode"], "plan[1]"),
        ("dsv4_online_compress_prefill", "online", VALID_ARGS["dsv4_online_compress_prefill"], "plan_c[2]"),
    ]
    for op, path, build, arg in compress:
        cases.append(
            _skip(op, f"a request past the state ({path})", build, _past_the_state, _neutral_past_the_state, arg)
        )
    s = "dsv4_compress_norm_rope_store"
    slots = 32 * STORE_PAGE
    cases += [
        _skip(
            s,
            "out_loc[3] past the cache (decode)",
            _store,
            _set("out_loc", 3, slots),
            _set("out_loc", 3, -1),
            "out_loc[3]",
        ),
        _skip(
            s,
            "out_loc[7] = 2^62 + 5 (prefill)",
            _store_prefill,
            _set("out_loc", 7, 2**62 + 5),
            _set("out_loc", 7, -1),
            "out_loc[7]",
        ),
        _skip(
            s,
            "a ragged id past out_loc (prefill: 5 entries, the plan's tokens 3 and 7)",
            _store_prefill,
            lambda a: {"out_loc": a["out_loc"][:5]},
            lambda a: {"out_loc": torch.cat([a["out_loc"][:5], torch.full((3,), -1)])},
            "plan[1]",
        ),
        _skip(
            s,
            "RoPE positions past freqs (decode)",
            _store,
            _store_freqs_short,
            _store_rows_past_freqs,
            f"plan[{_first_late_row(_store)}]",
        ),
    ]
    return cases


SKIPPED_VALUE_CASES: list[SkipCase] = _skipped_value_cases()
"""Value-level errors of the DeepSeek-V4 ops: CPU raises / CUDA skips and reports the rows invalid."""


# ---------------------------------------------------------------------------------------------- FlashMLA writes


def _flashmla_structural_cases() -> list[BadCase]:
    """`flashmla_cases.structural_cases` (tests/test_flashmla_contract.py runs them with their message regex)."""
    return [
        _case(op, case_id, change, error, _first_word(pattern))
        for case_id, op, change, error, pattern in structural_cases()
    ]


def _flashmla_cases() -> list[BadCase]:
    k, q, inplace = "fused_k_norm_rope_flashmla", "fused_q_norm_rope", "fused_norm_rope_inplace"
    store, indexer = "store_flashmla_cache", "fused_q_indexer_rope_hadamard_quant"
    return [
        *_flashmla_structural_cases(),
        _case(k, "kv fp64", lambda a: {"kv": a["kv"].double()}, TypeError, "kv"),
        _case(k, "kv width 256", lambda a: {"kv": a["kv"][:, :256]}, ValueError, "kv"),
        _case(k, "kv inner stride 2", lambda a: {"kv": _inner_strided(a["kv"])}, ValueError, "kv"),
        _case(k, "weight fp32", lambda a: {"weight": a["weight"].float()}, TypeError, "weight"),
        _case(k, "weight length", lambda a: {"weight": a["weight"][:256]}, ValueError, "weight"),
        _case(k, "freqs fp64", lambda a: {"freqs": a["freqs"].double()}, TypeError, "freqs"),
        _case(k, "freqs width 32", lambda a: {"freqs": a["freqs"][:, :32].contiguous()}, ValueError, "freqs"),
        _case(k, "freqs not contiguous", lambda a: {"freqs": _wide(a["freqs"], 64)}, ValueError, "freqs"),
        _case(k, "positions length", lambda a: {"positions": a["positions"][:7]}, ValueError, "positions"),
        _case(k, "out_loc int16", lambda a: {"out_loc": a["out_loc"].to(torch.int16)}, TypeError, "out_loc"),
        _case(k, "kvcache int8", lambda a: {"kvcache": a["kvcache"].to(torch.int8)}, TypeError, "kvcache"),
        _case(k, "kvcache width", lambda a: {"kvcache": a["kvcache"][:, :1152]}, ValueError, "kvcache"),
        _case(k, "kvcache row stride", lambda a: {"kvcache": _wide(a["kvcache"], 16)}, ValueError, "kvcache"),
        _case(k, "page_size 3", lambda a: {"page_size": 3}, ValueError, "page_size"),
        _case(k, "kvcache device", lambda a: {"kvcache": _meta(a["kvcache"])}, ValueError, "kvcache"),
        _case(q, "q int32", lambda a: {"q": a["q"].to(torch.int32)}, TypeError, "q"),
        _case(q, "q 2-D", lambda a: {"q": a["q"][:, 0]}, ValueError, "q"),
        _case(q, "q_out fp32", lambda a: {"q_out": a["q_out"].float()}, TypeError, "q_out"),
        _case(
            q,
            "q_out heads",
            lambda a: {"q_out": torch.zeros(8, HEADS + 1, 512, dtype=torch.bfloat16)},
            ValueError,
            "q_out",
        ),
        _case(q, "q_out inner stride 2", lambda a: {"q_out": _inner_strided(a["q_out"])}, ValueError, "q_out"),
        _case(q, "positions int16", lambda a: {"positions": a["positions"].to(torch.int16)}, TypeError, "positions"),
        _case(q, "q_out device", lambda a: {"q_out": _meta(a["q_out"])}, ValueError, "q_out"),
        _case(inplace, "kv fp64", lambda a: {"kv": a["kv"].double()}, TypeError, "kv"),
        _case(inplace, "weight length", lambda a: {"weight": a["weight"][:511]}, ValueError, "weight"),
        _case(
            inplace, "weight inner stride 2", lambda a: {"weight": _inner_strided(a["weight"])}, ValueError, "weight"
        ),
        _case(inplace, "freqs 1-D", lambda a: {"freqs": a["freqs"].reshape(-1)}, ValueError, "freqs"),
        _case(inplace, "freqs device", lambda a: {"freqs": _meta(a["freqs"])}, ValueError, "freqs"),
        _case(store, "kv 3-D", lambda a: {"kv": a["kv"][None]}, ValueError, "kv"),
        _case(store, "out_loc length", lambda a: {"out_loc": a["out_loc"][:-1]}, ValueError, "out_loc"),
        _case(store, "kvcache int32", lambda a: {"kvcache": a["kvcache"].view(torch.int32)}, TypeError, "kvcache"),
        _case(store, "page_size 0", lambda a: {"page_size": 0}, ValueError, "page_size"),
        _case(
            store,
            "kvcache for another page size",
            lambda a: {"kvcache": torch.zeros(4, custom_ops.flashmla_page_bytes(4), dtype=torch.uint8)},
            ValueError,
            "kvcache",
        ),
        _case(store, "out_loc device", lambda a: {"out_loc": _meta(a["out_loc"])}, ValueError, "out_loc"),
        _case(indexer, "q width 64", lambda a: {"q": a["q"][..., :64]}, ValueError, "q"),
        _case(indexer, "q fp64", lambda a: {"q": a["q"].double()}, TypeError, "q"),
        _case(indexer, "q inner stride 2", lambda a: {"q": _inner_strided(a["q"])}, ValueError, "q"),
        _case(indexer, "weight heads", lambda a: {"weight": a["weight"][:, :2]}, ValueError, "weight"),
        _case(indexer, "positions float", lambda a: {"positions": a["positions"].float()}, TypeError, "positions"),
        _case(indexer, "freqs bf16", lambda a: {"freqs": a["freqs"].bfloat16()}, TypeError, "freqs"),
        _case(indexer, "weight device", lambda a: {"weight": _meta(a["weight"])}, ValueError, "weight"),
    ]


# ---------------------------------------------------------------------------------------------- multi_linear*


def _multi_linear_cases() -> list[BadCase]:
    """`multi_linear_cases.MULTI_LINEAR_BAD_INPUTS` (tests/test_multi_linear.py runs them with their regex)."""
    return [
        BadCase("multi_linear", case_id, functools.partial(_multi_linear, mutate), error, arg)
        for case_id, mutate, error, _, arg in MULTI_LINEAR_BAD_INPUTS
    ]


def _kv_write_cases() -> list[BadCase]:
    """`multi_linear_cases.BAD_CASES` (both sides) and `CUDA_ONLY_CASES` (the CUDA binding's layout rules)."""
    w = "multi_linear_kv_write"
    both = [_case(w, case_id, change, error, _first_word(start)) for case_id, change, error, start in BAD_CASES]
    layout = [
        _case(
            w,
            case_id,
            change or (lambda a: {}),
            error,
            _first_word(name),
            only="cuda",
            reason=_KV_WRITE_CUDA_ONLY,
            build=functools.partial(_spec_args, spec),
        )
        for case_id, spec, change, error, name in CUDA_ONLY_CASES
    ]
    return both + layout


def _spec_args(spec) -> dict:
    return make_case(spec).args


BAD_ARGUMENT_CASES: list[BadCase] = [
    *_planner_cases(),
    *_row_length_cases(),
    *_compress_cases(),
    *_store_cases(),
    *_flashmla_cases(),
    *_multi_linear_cases(),
    *_kv_write_cases(),
]
