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

CPU and CUDA both run one `mm`/`addmm` per weight straight into the output column block (the fast small-T
CUDA kernel is a later issue). The CUDA path is CUDA-graph safe: no host syncs, no data-dependent shapes.
"""

from collections.abc import Sequence

import torch

from custom_ops._library import LIB

LIB.define("multi_linear(Tensor x, Tensor[] weights, int[] row_starts, int[] row_counts, Tensor?[] biases) -> Tensor")


def _check_args(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    row_starts: Sequence[int],
    row_counts: Sequence[int],
    biases: Sequence[torch.Tensor | None],
) -> None:
    if x.dim() != 2:
        raise ValueError(f"multi_linear: x must be 2-D [T, K], got shape {tuple(x.shape)}")
    n = len(weights)
    if n == 0:
        raise ValueError("multi_linear: weights must hold at least one tensor")
    if not (len(row_starts) == len(row_counts) == len(biases) == n):
        raise ValueError(
            "multi_linear: weights, row_starts, row_counts and biases must have the same length, got "
            f"{n}, {len(row_starts)}, {len(row_counts)}, {len(biases)}"
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
        if start < 0 or count < 0 or start + count > w.shape[0]:
            raise ValueError(
                f"multi_linear: rows [{start}, {start + count}) of weights[{i}] are out of range "
                f"(it has {w.shape[0]} rows)"
            )
        if b is not None and (b.shape != (w.shape[0],) or b.dtype != x.dtype or b.device != x.device):
            raise ValueError(
                f"multi_linear: biases[{i}] must be [{w.shape[0]}] {x.dtype} on {x.device}, "
                f"got {tuple(b.shape)} {b.dtype} on {b.device}"
            )


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


@torch.library.register_fake("dspark::multi_linear")
def _multi_linear_fake(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    row_starts: Sequence[int],
    row_counts: Sequence[int],
    biases: Sequence[torch.Tensor | None],
) -> torch.Tensor:
    _check_args(x, weights, row_starts, row_counts, biases)
    return x.new_empty((x.shape[0], sum(row_counts)))


LIB.impl("multi_linear", multi_linear_reference, "CPU")
LIB.impl("multi_linear", multi_linear_reference, "CUDA")
