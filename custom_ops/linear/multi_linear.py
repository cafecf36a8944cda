"""`dspark::multi_linear` — one activation times the row ranges of several weights, into one output.

The horizontal-fusion pass in `dspark_fx` replaces N `mm`/`addmm` nodes that share an activation with one call
of this op. The op reads the *original* weight tensors (the graph's parameter placeholders) at the given row
ranges, so nothing is concatenated per call, no extra weight memory exists, and an in-place weight update
(`copy_`, `load_state_dict`) is seen by the next call. Branch `i` of the output is the column block
`out[:, offsets[i] : offsets[i] + row_counts[i]]` with `offsets = cumsum([0] + row_counts)[:-1]`.

| arg          | shape / type            | dtype            | mutated | meaning                                        |
|--------------|-------------------------|------------------|---------|------------------------------------------------|
| `x`          | `[T, K]`                | fp32/fp16/bf16   | no      | shared activation (any strides)                |
| `weights`    | list of N `[R_i, K]`    | same as `x`      | no      | full weight tensors, `[out, in]` layout        |
| `row_starts` | list of N `int`         | —                | no      | first row used of weight `i`                   |
| `row_counts` | list of N `int`         | —                | no      | rows used of weight `i` (columns of its block) |
| `biases`     | list of N `[R_i]`/None  | same as `x`      | no      | optional bias per weight, sliced like the rows |
| returns      | `[T, Σ row_counts]`     | same as `x`      | —       | fresh tensor                                   |

Which path runs:

| device | when                                                      | path                                           |
|--------|-----------------------------------------------------------|------------------------------------------------|
| CPU    | always                                                    | one `mm`/`addmm` per weight (the reference)    |
| CUDA   | bf16/fp16, K % 8 == 0, sm_90 (the sm_90a code), layout    | the streaming kernel (e), one launch per 64    |
|        | (a), T <= 16, and 1 to 8 blocks of 16 rows per SM         | row ranges                                     |
| CUDA   | bf16/fp16, K % 8 == 0, sm_90+, layout (a), and T <= 8,    | the kernel, one launch per 64 row ranges       |
|        | or T <= 32 for >= 2 row ranges of <= 4096 rows on average |                                                |
|        | unless cuBLAS can batch all of them (c); never a single   |                                                |
|        | range that cuBLAS cuts into row blocks (d)                |                                                |
| CUDA   | otherwise (fp32, larger T, other K, other layouts)        | cuBLAS: batched GEMMs (c), strided row blocks  |
|        |                                                           | (d), one `mm`/`addmm` per other row range (b)  |

(a) every used weight row range has unit inner stride and 16-byte aligned rows (a weight view with any row stride
that keeps rows 16-byte aligned qualifies). (b) written straight into its column block of the output. (c) at every T,
bf16/fp16 row ranges without bias that share their row stride and whose row counts have a gcd of >= 256 (halved
while above 2048) are cut into row blocks of that height, all in one `cublasGemmBatchedEx` (q/k/v of
[4096 | 1024 | 1024] rows: six blocks of 1024, 20.1 µs at 16 tokens, where a GEMM for q and a batched one for k and
v took 25 µs); where the gcd is smaller, ranges that share their row count are batched whole (the DSpark KV group
of 5 layers at 64 tokens takes 29 instead of 53 µs one GEMM each). In an eager call the per-GEMM pointers are
written to a small device tensor by a one-block kernel from a by-value kernel parameter (no host sync); while a CUDA
graph is captured they are copied to device memory once, at capture time, and kept (`captured_pointer_tables()`;
docs/ops.md). (d) a single such range of >= 4096 rows at T <= 64 is one strided batched GEMM of row blocks (no
pointer table): cuBLAS's tiles for one GEMM of a few thousand rows leave bandwidth unused ([4096, 12288] at 16
tokens: 32.8 against 34.2 µs). cuBLAS cannot check pointers it reads from
device memory and assumes them aligned, so a range is batched only if its weight rows and its output column block
start 16-byte aligned with row strides of a multiple of 8 elements (a row count before it or an output width that
is not a multiple of 8 keeps it out), and the batched GEMMs read `x` only if it is aligned so too, else a contiguous
copy (none when K % 8 != 0: then nothing is batched). The rule is `kernel_pays` in
`csrc/linear/multi_linear.cu`, measured on an H200 (BENCHMARKS.md); `uses_kernel(tokens, row_counts)` and
`cublas_batches(row_counts)` (whether a batched GEMM with a pointer table runs) evaluate it. (e) the
streaming kernel (`csrc/linear/multi_linear_stream.cuh`): one CTA per SM, each an equal share of the 16-row blocks
of the output, the weights streamed through shared memory in 2 KB bulk copies of the copy engine; it runs where
the rows give every SM 1 to 8 such blocks (the K/V of a 5-layer draft, q/k/v, single [4096, K] weights) at up to 16
tokens for several row ranges and up to 8 for one (`stream_pays`; `uses_stream(tokens, row_counts)` evaluates it):
in one launch after an L2 flush it read those groups 6-13 % faster than the tile kernel and 2-11 % faster than
cuBLAS on a concatenated copy (H100, BENCHMARKS.md "The streaming kernel"); in the op's table (CUDA-graph replay)
a single weight at 16 tokens ran 1-5 % slower than cuBLAS, hence 8 there. The kernel itself
handles up to 64 tokens (`_multi_linear_variant` forces it); `_multi_linear_cublas(..., batched)` forces the cuBLAS
path, batched or one GEMM per range.

On CUDA, consecutive row ranges that lie back to back in memory (weight `i + 1`'s first used row right after weight
`i`'s last, same row stride, biases both absent or also back to back) are treated as one range: one GEMM over the
stacked view, one kernel segment. That is found from data pointers and strides on the host, without a sync. The
activation's own layout never blocks the kernel: rows that are not 16-byte aligned or a non-unit inner stride get a
contiguous copy of `x` (T x K, small).

The kernel (see the header of `csrc/linear/multi_linear_kernels.cuh`): tensor-core `mma.sync` with the weight rows
as the M dimension, tiles of 16-128 concatenated output rows, the K dimension split over the warps of a CTA and over
the CTAs of a thread-block cluster (split-K reduced through distributed shared memory; clusters and programmatic
dependent launch only on sm_90, the GPU that runs the library's sm_90a code: others run its portable PTX, which has
neither, so they get one CTA per tile and stream-ordered launches), each weight byte read once
from HBM with 16-byte asynchronous copies. Its parameters (weight pointers, row strides, bias pointers, segment
ends) travel by value in one `__grid_constant__` kernel parameter of fixed size: 64 row ranges per launch (2.6 KB,
inside the classic 4 KB parameter limit); a group with more non-adjacent ranges takes one launch per 64, each
writing its own output columns. This keeps the kernel free of host syncs, device-side tables and workspaces:
the op allocates only its output (and, on the batched cuBLAS path, its pointer table), keeps no state between calls
but the captured pointer tables, and is CUDA-graph capturable; the output shape depends only on `x.shape[0]` and the
row counts, so it works with a symbolic T in compiled graphs (the fake impl gives it).

`dspark::_multi_linear_variant(..., int variant, int split)` (CUDA only, for the benchmark sweep and the tests) runs
the kernel with a forced tile configuration (`kernel_variants()`, -1: the default one) and cluster split (1..8; 0:
automatic; above 1 only on sm_90), for any T up to 64, or the streaming kernel (`STREAM_VARIANT`, T up to 16, split
0 or 1, sm_90), and raises `ValueError` where the kernel cannot run.
"""

import ctypes
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from custom_ops import _build
from custom_ops._library import register_op

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the activations and weights the op takes


def _check_args(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    row_starts: Sequence[int],
    row_counts: Sequence[int],
    biases: Sequence[torch.Tensor | None],
) -> None:
    """The op's structural rules, each message starting with the argument it is about (the C++ binding raises the
    same class and message)."""
    if x.dim() != 2:
        raise ValueError(f"multi_linear: x must be 2-D [T, K], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"multi_linear: x must be bfloat16, float16 or float32, got {x.dtype}")
    n = len(weights)
    if n == 0:
        raise ValueError("multi_linear: weights must hold at least one tensor")
    for name, values in (("row_starts", row_starts), ("row_counts", row_counts), ("biases", biases)):
        if len(values) != n:
            raise ValueError(
                f"multi_linear: {name} must hold one entry per weight ({n}, the length of weights), got {len(values)}"
            )
    for i, (w, start, count, b) in enumerate(zip(weights, row_starts, row_counts, biases, strict=True)):
        if w.dim() != 2 or w.shape[1] != x.shape[1]:
            raise ValueError(
                f"multi_linear: weights[{i}] must be [R, {x.shape[1]}] (x is {tuple(x.shape)}), got {tuple(w.shape)}"
            )
        if w.dtype != x.dtype:
            raise TypeError(f"multi_linear: weights[{i}] dtype {w.dtype} differs from x dtype {x.dtype}")
        if w.device != x.device:
            raise ValueError(f"multi_linear: weights[{i}] is on {w.device}, x is on {x.device}")
        if count < 0:
            raise ValueError(f"multi_linear: row_counts[{i}] must be >= 0, got {count}")
        if start < 0 or start + count > w.shape[0]:
            raise ValueError(
                f"multi_linear: row_starts[{i}] = {start}: rows [{start}, {start + count}) of weights[{i}] are out "
                f"of range (it has {w.shape[0]} rows)"
            )
        if b is None:
            continue
        if b.shape != (w.shape[0],):
            raise ValueError(
                f"multi_linear: biases[{i}] must be [{w.shape[0]}] (one entry per row of weights[{i}]), "
                f"got {tuple(b.shape)}"
            )
        if b.dtype != x.dtype:
            raise TypeError(f"multi_linear: biases[{i}] dtype {b.dtype} differs from x dtype {x.dtype}")
        if b.device != x.device:
            raise ValueError(f"multi_linear: biases[{i}] is on {b.device}, x is on {x.device}")


def multi_linear_reference(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    row_starts: Sequence[int],
    row_counts: Sequence[int],
    biases: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    """Per-weight GEMMs written straight into the output column blocks (CPU reference and CUDA fallback)."""
    _check_args(x, weights, row_starts, row_counts, biases)
    out = x.new_empty((x.shape[0], sum(row_counts)))
    col = 0
    for w, start, count, b in zip(weights, row_starts, row_counts, biases, strict=True):
        block = out[:, col : col + count]
        w_t = w[start : start + count].t()
        if b is None:
            torch.mm(x, w_t, out=block)
        else:
            torch.addmm(b[start : start + count], x, w_t, out=block)
        col += count
    return out


def _multi_linear_fake(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    row_starts: Sequence[int],
    row_counts: Sequence[int],
    biases: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    _check_args(x, weights, row_starts, row_counts, biases)
    return x.new_empty((x.shape[0], sum(row_counts)))


@dataclass(frozen=True)
class KernelVariant:
    """A compiled tile configuration of the CUDA kernel (`kVariants` in `csrc/linear/multi_linear_kernels.cuh`)."""

    index: int
    m_tiles: int  # 16-row MMA tiles per warp
    row_warps: int  # warps splitting the CTA's rows
    k_warps: int  # warps splitting the CTA's K range
    stages: int  # shared-memory stages per warp (stages - 1 steps of 32 columns in flight)

    @property
    def rows(self) -> int:
        """Output rows (weight rows) per CTA."""
        return 16 * self.m_tiles * self.row_warps

    @property
    def warps(self) -> int:
        return self.row_warps * self.k_warps

    def __str__(self) -> str:
        return f"v{self.index}:{self.rows}r/{self.warps}w/k{self.k_warps}/d{self.stages}"


def _native() -> ctypes.CDLL:
    return ctypes.CDLL(str(_build.load()))


def kernel_token_threshold() -> int:
    """Largest token count (rows of `x`) for which the CUDA op runs the kernel for any group but a single range that
    cuBLAS cuts into row blocks (builds the library if needed); see `uses_kernel` for the groups that take it up to
    32 tokens."""
    return int(_native().dspark_multi_linear_token_threshold())


def uses_kernel(tokens: int, row_counts: Sequence[int]) -> bool:
    """Whether the CUDA op runs the kernel for `tokens` rows of `x` over separate (not adjacent in memory) row ranges
    of `row_counts` rows without biases, given a kernel-readable bf16/fp16 layout (x and weight rows 16-byte aligned,
    row strides multiples of 8 elements) and one row stride per row count (the rule of `kernel_pays` in the
    binding), where the streaming kernel does not take the call (`uses_stream`)."""
    runs = [c for c in row_counts if c > 0]
    lib = _native()
    lib.dspark_multi_linear_uses_kernel.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int]
    batched = _in_strided_blocks(tokens, runs) if len(runs) == 1 else _all_batched(runs)
    return bool(lib.dspark_multi_linear_uses_kernel(tokens, len(runs), sum(runs), int(batched)))


STREAM_VARIANT = -2  # `_multi_linear_variant`'s index of the streaming kernel (kStreamVariant in the binding)


def uses_stream(tokens: int, row_counts: Sequence[int], device: torch.device | str | int | None = None) -> bool:
    """Whether the CUDA op runs the streaming kernel for `tokens` rows of `x` over separate (not adjacent in memory)
    row ranges of `row_counts` rows on `device` (default: the current CUDA device), given a kernel-readable bf16/fp16
    layout (the rule of `stream_pays` in the binding: 1 to 8 blocks of 16 output rows per SM, up to 16 tokens for
    several ranges and 8 for one; only GPUs that run the library's sm_90a code stream)."""
    props = torch.cuda.get_device_properties(device)
    if (props.major, props.minor) != (9, 0):
        return False
    runs = [c for c in row_counts if c > 0]
    lib = _native()
    lib.dspark_multi_linear_uses_stream.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return bool(lib.dspark_multi_linear_uses_stream(tokens, len(runs), sum(runs), props.multi_processor_count))


def _in_strided_blocks(tokens: int, runs: Sequence[int]) -> bool:
    """Whether a single range is cut into row blocks (one strided batched GEMM) at `tokens` tokens."""
    lib = _native()
    lib.dspark_multi_linear_strided_block.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.dspark_multi_linear_strided_block.restype = ctypes.c_int64
    return bool(_batchable(runs)) and lib.dspark_multi_linear_strided_block(tokens, runs[0]) > 0


def _batchable(runs: Sequence[int]) -> list[int]:
    """The row counts of the non-empty ranges `runs` that the cuBLAS path may batch: none when the output's width is
    not a multiple of 8, else those whose output column block starts at a multiple of 8 (16-byte aligned for
    bf16/fp16)."""
    if sum(runs) % 8:
        return []
    return [c for c, col in zip(runs, itertools.accumulate(runs, initial=0), strict=False) if col % 8 == 0]


def _in_blocks(batchable: Sequence[int]) -> bool:
    """Whether the batchable ranges (one row stride) form one batched GEMM of row blocks (the C rule, `block_rows`)."""
    lib = _native()
    lib.dspark_multi_linear_block_rows.argtypes = [ctypes.c_int64]
    lib.dspark_multi_linear_block_rows.restype = ctypes.c_int64
    return len(batchable) >= 2 and lib.dspark_multi_linear_block_rows(math.gcd(*batchable)) > 0


def _all_batched(runs: Sequence[int]) -> bool:
    batchable = _batchable(runs)
    if len(batchable) != len(runs):
        return False
    return _in_blocks(batchable) or all(batchable.count(c) >= 2 for c in batchable)


def cublas_batches(row_counts: Sequence[int]) -> bool:
    """Whether the CUDA op's cuBLAS path runs a batched GEMM with a pointer table for some of these row ranges (same
    assumptions as `uses_kernel`): ranges cut into row blocks of one height, or ranges of one shape."""
    batchable = _batchable([c for c in row_counts if c > 0])
    return _in_blocks(batchable) or any(batchable.count(c) >= 2 for c in batchable)


def captured_pointer_tables() -> int:
    """How many pointer tables of batched GEMMs CUDA-graph captures have written to device memory once and kept (a
    capture's batched GEMM reads one of these instead of a table written by a kernel on every replay)."""
    lib = _native()
    lib.dspark_multi_linear_captured_tables.restype = ctypes.c_int64
    return int(lib.dspark_multi_linear_captured_tables())


def kernel_variants() -> list[KernelVariant]:
    """The kernel's compiled tile configurations, in the order `_multi_linear_variant` indexes them."""
    lib = _native()
    fields = (ctypes.c_int * 4)()
    variants = []
    for i in range(lib.dspark_multi_linear_num_variants()):
        if lib.dspark_multi_linear_variant(ctypes.c_int(i), fields) != 0:
            raise RuntimeError(f"dspark_multi_linear_variant({i}) failed")
        variants.append(KernelVariant(i, *fields))
    return variants


def _setup_backward(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weights, row_starts, row_counts, biases = inputs
    if any(b is None for b in biases) and any(b is not None and b.requires_grad for b in biases):
        raise ValueError(
            "multi_linear: biases needs a gradient but holds None entries: torch.library differentiates a tensor "
            "list only when every entry is a tensor, so pass zeros for the ranges without a bias"
        )
    ctx.save_for_backward(x, *weights)
    ctx.ranges = (list(row_starts), list(row_counts))
    ctx.bias_shapes = [None if b is None else b.shape for b in biases]


def _backward(ctx, grad: torch.Tensor) -> tuple:
    """Each range's block of `grad` against its rows: `x`'s gradient sums `g_i @ W_i` (in fp32, rounded once, as one
    GEMM over the concatenated rows would), weight `i` gets `g_i^T @ x` in its used rows (zeros elsewhere), a bias
    the column sums of `g_i` in its used rows."""
    x, *weights = ctx.saved_tensors
    starts, counts = ctx.ranges
    grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[0] else None
    grad_weights, grad_biases, col = [], [], 0
    for w, start, count, bias_shape in zip(weights, starts, counts, ctx.bias_shapes, strict=True):
        g = grad[:, col : col + count]
        col += count
        if grad_x is not None:
            grad_x += g.float() @ w[start : start + count].float()
        gw = torch.zeros_like(w)
        gw[start : start + count] = g.transpose(0, 1) @ x
        grad_weights.append(gw)
        if bias_shape is None:
            grad_biases.append(None)
        else:
            gb = grad.new_zeros(bias_shape)
            gb[start : start + count] = g.sum(0)
            grad_biases.append(gb)
    grad_x = None if grad_x is None else grad_x.to(x.dtype)
    return grad_x, grad_weights, None, None, None if any(g is None for g in grad_biases) else grad_biases


register_op(
    "multi_linear(Tensor x, Tensor[] weights, int[] row_starts, int[] row_counts, Tensor?[] biases) -> Tensor",
    reference=multi_linear_reference,
    fake=_multi_linear_fake,
    backward=_backward,
    setup_context=_setup_backward,
)


def _cuda_only(name: str) -> Callable[..., torch.Tensor]:
    """The CPU kernel of a CUDA-only debug op: says so (the dispatcher's default would name no reason)."""

    def cpu(*args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError(
            f"dspark::{name} is a CUDA-only debug op (a forced CUDA path of multi_linear); on CPU use "
            "dspark::multi_linear"
        )

    return cpu


register_op(  # CUDA only: the kernel with a forced tile and split; no fake (not traceable)
    "_multi_linear_variant(Tensor x, Tensor[] weights, int[] row_starts, int[] row_counts, Tensor?[] biases, "
    "int variant, int split) -> Tensor",
    reference=_cuda_only("_multi_linear_variant"),
)
register_op(  # CUDA only: the cuBLAS path, batched or one GEMM per range; no fake (not traceable)
    "_multi_linear_cublas(Tensor x, Tensor[] weights, int[] row_starts, int[] row_counts, Tensor?[] biases, "
    "bool batched) -> Tensor",
    reference=_cuda_only("_multi_linear_cublas"),
)
