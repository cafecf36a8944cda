"""Matrix products whose contraction is one element wide (outer products) become broadcast multiplies.

HF transformers computes RoPE angles as `inv_freq[None, :, None] @ position_ids[:, None, :]`, then transposes:

Before (on CUDA Inductor keeps the `bmm`, a cuBLAS call whose `[B, head_dim/2, T]` output every RoPE kernel then
reads transposed, one row per element):

    freqs = bmm(inv_freq_3d [B, D/2, 1], pos_3d [B, 1, T])      # [B, D/2, T], contiguous
    angles = permute(freqs, [0, 2, 1])                          # [B, T, D/2], read with stride T
    cos = cos(cat([angles, angles], -1)) ...

After (a pointwise op that Inductor fuses into its readers: each kernel computes the angle of the element it
writes from `inv_freq[d]` and `pos[t]`, no transposed buffer, no GEMM launch):

    freqs = mul(inv_freq_3d [B, D/2, 1], pos_3d [B, 1, T])      # the same values, the same strides
    angles = permute(freqs, [0, 2, 1]) ...

With one element to sum, each output of the product is one rounded multiply, as in the matmul: the rewrite gives
the same values (the same bits but where a GEMM library differs from a plain multiply at the edges: a CPU GEMM in
bf16/fp16 returns +0.0 for a product of -0.0 and flushes products below the normal range to zero, where the
multiply keeps both, as Inductor's own rewrite does). Not where the matmul may round its fp32 inputs first (TF32,
`torch.set_float32_matmul_precision` other than "highest"), nor where the multiply's result would have other strides
than the matmul's.
(Inductor's own decompositions do this for `bmm` from torch 2.13 on; on torch 2.11 the pass does.)
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dspark_fx.passes.graph_utils import aten, call, tensor_val

# matmul overload -> the dim of its first operand that is contracted
_PRODUCTS = {aten.mm.default: 1, aten.bmm.default: 2}


def _rounds_fp32_inputs(value: torch.Tensor) -> bool:
    """Whether a matmul of `value`'s fp32 operands may round them first (TF32, bf16), unlike a multiply."""
    return value.dtype == torch.float32 and rounds_fp32_matmul_inputs(value.device.type)


def rounds_fp32_matmul_inputs(device_type: str) -> bool:
    """Whether an fp32 matmul on `device_type` may round its inputs first, as torch's settings stand now."""
    try:
        return torch.get_float32_matmul_precision() != "highest" or (
            device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        )
    except RuntimeError:  # the legacy and the per-backend settings were both set: read the backend's own
        backend = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul
        precision = getattr(backend, "fp32_precision", "none")
        if precision == "none":  # inherits the generic setting ("none" there too: IEEE)
            precision = getattr(torch.backends, "fp32_precision", "none")
        return precision not in ("ieee", "none")


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(statically_known_true(x == y) for x, y in zip(a.stride(), b.stride(), strict=True))


def multiply_outer_products(graph: fx.Graph) -> list[str]:
    """Replace every `mm`/`bmm` with a contraction of one element by `mul` (module docstring); returns a
    description of each product replaced."""
    replaced = []
    for node in list(graph.find_nodes(op="call_function", target=aten.mm.default)) + list(
        graph.find_nodes(op="call_function", target=aten.bmm.default)
    ):
        if node.kwargs or len(node.args) != 2:
            continue
        left, right = node.args
        out, a, b = tensor_val(node), tensor_val(left), tensor_val(right)
        if out is None or a is None or b is None or a.dtype != b.dtype or _rounds_fp32_inputs(a):
            continue
        if not statically_known_true(a.shape[_PRODUCTS[node.target]] == 1):
            continue
        with graph.inserting_before(node):
            product = call(graph, aten.mul.Tensor, (left, right))
        if not _same_strides(tensor_val(product), out):
            graph.erase_node(product)
            continue
        product.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        replaced.append(f"{node.target.overloadpacket.__name__} {list(a.shape)} @ {list(b.shape)}")
    return replaced
