"""dspark::multi_linear on CUDA: the small-T kernel and the cuBLAS path against an fp64 formula, every kernel variant
and split, layouts (row slices, empty ranges, weight views, strided and misaligned activations), adjacent weights
(merged, except where that would split one batched GEMM), more weights than one launch holds, CUDA graphs (every
output element rewritten on replay, in-place weight updates seen), torch.compile with a symbolic T, concurrent
streams, opcheck and the argument errors of the CPU path."""

from __future__ import annotations

import ctypes

import pytest
import torch
from multi_linear_cases import fp64_formula

import custom_ops  # noqa: F401
from custom_ops import _build
from custom_ops.linear.multi_linear import (
    STREAM_VARIANT,
    _check_args,
    captured_pointer_tables,
    cublas_batches,
    kernel_token_threshold,
    kernel_variants,
    uses_kernel,
    uses_stream,
)

pytestmark = pytest.mark.cuda

op = torch.ops.dspark.multi_linear
variant_op = torch.ops.dspark._multi_linear_variant


@pytest.fixture(autouse=True, scope="module")
def _cuda_library():
    _build.load()


def _check(out, ref):
    """One rounding of an fp32 sum to bf16/fp16 against fp64: elementwise and relative Frobenius error; no NaN."""
    assert out.shape == ref.shape
    assert not torch.isnan(out).any()
    if ref.numel() == 0:
        return
    scale = ref.abs().max().item() + 1e-6
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2 * scale)
    assert ((out.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item() < 1e-2


def _case(tokens, k, counts, *, dtype=torch.bfloat16, seed=0, bias=(False, True), pad_rows=3, pad_k=16, bias_scale=1.0):
    """Fresh random CUDA inputs: weights are column slices `[rows, K]` of `[rows, K + pad_k]` CUDA tensors (row stride
    K + pad_k, still 16-byte aligned; sliced after the move, which would make a gapped view contiguous) with
    `pad_rows` unused rows before and after the used range; biases (times `bias_scale`) alternate."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen).to(dtype).cuda()
    weights, starts, biases = [], [], []
    for i, c in enumerate(counts):
        rows = c + 2 * pad_rows
        weight = torch.randn(rows, k + pad_k, generator=gen).to(dtype).cuda()[:, :k]
        assert weight.stride(0) == k + pad_k
        weights.append(weight)
        starts.append(pad_rows)
        biases.append((bias_scale * torch.randn(rows, generator=gen)).to(dtype).cuda() if bias[i % len(bias)] else None)
    return x, weights, starts, list(counts), biases


GROUPS = {
    "one weight, K=4096, 1000 rows": (4096, [1000]),
    "two weights, K=2560": (2560, [333, 517]),
    "five weights, K=64, empty range": (64, [16, 7, 0, 33, 1]),
    "sixteen weights, K=8": (8, [3, 0, 17, 1, 40, 16, 5, 9, 2, 31, 0, 8, 13, 1, 6, 22]),
}


def _token_counts() -> list[int]:
    threshold = kernel_token_threshold()
    return sorted({1, 2, 7, 16, threshold - 1, threshold, threshold + 1, 32, 33, 64, 128})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", list(GROUPS))
def test_matches_fp64(group, dtype):
    k, counts = GROUPS[group]
    for tokens in _token_counts():
        args = _case(tokens, k, counts, dtype=dtype, seed=tokens)
        out = op(*args)
        assert out.dtype == dtype and out.shape == (tokens, sum(counts))
        _check(out, fp64_formula(*args))


def test_decode_groups_of_the_benchmark():
    """The fused KV group (5 x [2048, 4096]) and q/k/v with biases at decode sizes."""
    for tokens in (1, 16, 64):
        kv = _case(tokens, 4096, [2048] * 5, seed=1, bias=(False,))
        _check(op(*kv), fp64_formula(*kv))
        qkv = _case(tokens, 4096, [4096, 1024, 1024], seed=2, bias=(True,))
        _check(op(*qkv), fp64_formula(*qkv))


@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_every_variant_and_split(tokens):
    """Each compiled tile configuration with automatic and forced cluster splits; a second run is bit-identical (no
    race in the split-K reduction)."""
    args = _case(tokens, 1032, [40, 0, 300, 17], seed=tokens)
    ref = fp64_formula(*args)
    for v in kernel_variants():
        for split in (0, 1, 2, 3, 8):
            out = variant_op(*args, v.index, split)
            _check(out, ref)
            assert torch.equal(out, variant_op(*args, v.index, split)), f"{v} split {split} is not deterministic"


def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _streams_here() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the streaming kernel runs the sm_90a code",
)


@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("k", "counts"),
    [
        (4096, [2048, 2048]),  # stages of 1024 columns, whole
        (1000, [40, 0, 300, 17]),  # a ragged last stage; blocks spanning weights; a partial last block
        (8, [33, 5]),  # K shorter than one 32-column step
        (2056, [4000, 24, 100]),  # two full stages and a ragged one
    ],
)
def test_the_streaming_kernel_matches_fp64(k, counts, dtype):
    """The streaming kernel forced (`STREAM_VARIANT`) at 1 to 16 tokens (one and two token tiles), weights with a row
    stride != K, x read in place as an aligned column slice of a wider tensor, biases on some weights (as large as
    the products, so a dropped one fails); every output element written (NaN-poisoned memory), and a second run
    bit-identical (the consumer warps' partial sums are added in a fixed order)."""
    for tokens in (1, 3, 8, 9, 16):
        x, weights, starts, counts_, biases = _case(tokens, k, counts, dtype=dtype, seed=tokens + k, bias_scale=k**0.5)
        wide = torch.randn(tokens, k + 24, device="cuda", dtype=dtype)
        wide[:, 8 : 8 + k] = x
        args = (wide[:, 8 : 8 + k], weights, starts, counts_, biases)
        torch.full((tokens * sum(counts) + 1024,), float("nan"), device="cuda", dtype=dtype)  # freed, reused below
        out = variant_op(*args, STREAM_VARIANT, 0)
        _check(out, fp64_formula(*args))
        assert torch.equal(out, variant_op(*args, STREAM_VARIANT, 1))


@needs_sm90
def test_the_streaming_kernel_with_more_weights_than_one_launch():
    """70 row ranges: two launches of the streaming kernel, each over its own output columns and its own CTAs."""
    counts = [1 + (i * 37) % 61 for i in range(70)]
    args = _case(11, 264, counts, seed=9, pad_rows=1, bias=(True, False))
    _check(variant_op(*args, STREAM_VARIANT, 0), fp64_formula(*args))


@needs_sm90
@pytest.mark.parametrize("tokens", [1, 8, 9, 16, 17])
def test_the_op_streams_where_the_rule_says(tokens):
    """Row ranges whose 16-row blocks give every SM one to eight of them stream at up to 16 tokens (the K/V weights
    of a five-layer draft, q/k/v of one layer), a single range at up to 8 (one [4096, 4096] weight); fewer blocks
    than SMs, more than eight per SM, and 17 tokens do not; the kernel the profiler sees is the one `uses_stream`
    names."""
    sms = _sm_count()
    cases = {
        "K/V of 5 layers": (512, [2048] * 5),
        "q/k/v": (512, [4096, 1024, 1024]),
        "one [4096, 4096] weight": (512, [4096]),
        "fewer blocks than SMs": (512, [16 * sms - 16]),
        "more than 8 blocks per SM": (128, [64 * sms, 64 * sms + 16]),
    }
    for name, (k, counts) in cases.items():
        args = _case(tokens, k, counts, seed=len(name), pad_rows=1, bias=(False,))
        blocks = -(-sum(counts) // 16)
        expected = sms <= blocks <= 8 * sms and tokens <= (16 if len(counts) >= 2 else 8)
        assert uses_stream(tokens, counts) == expected, name
        names = _kernel_names(lambda a=args: op(*a))
        assert any("multi_linear_stream_kernel" in n for n in names) == expected, (name, names)
        _check(op(*args), fp64_formula(*args))


def test_default_variant_equals_the_op():
    args = _case(16, 512, [64, 96], seed=3)
    assert torch.equal(op(*args), variant_op(*args, -1, 0))


@pytest.mark.parametrize("offset", [0, 8, 5])
def test_strided_and_misaligned_activation(offset):
    """x as a column slice of a wider tensor (aligned: read in place; offset 5: not 16-byte aligned, copied) and with
    a non-unit inner stride: the same result as a contiguous x."""
    x, weights, starts, counts, biases = _case(12, 256, [48, 20], seed=offset)
    wide = torch.randn(12, 256 + 16, device="cuda", dtype=x.dtype)
    wide[:, offset : offset + 256] = x
    expected = op(x, weights, starts, counts, biases)
    assert torch.equal(op(wide[:, offset : offset + 256], weights, starts, counts, biases), expected)
    doubled = torch.randn(12, 512, device="cuda", dtype=x.dtype)
    doubled[:, ::2] = x
    assert torch.equal(op(doubled[:, ::2], weights, starts, counts, biases), expected)


@pytest.mark.parametrize("layout", ["transposed", "misaligned", "odd row stride"])
def test_weight_layouts_the_kernel_cannot_read(layout):
    """Weights the kernel cannot read with 16-byte loads take the cuBLAS path: still correct."""
    x, weights, starts, counts, biases = _case(8, 128, [32, 24], seed=4)
    base = weights[1]
    if layout == "transposed":
        weights[1] = base.t().contiguous().t()
    elif layout == "misaligned":
        weights[1] = torch.empty(base.shape[0], 130, device="cuda", dtype=base.dtype)[:, 1:129].copy_(base)
    else:
        weights[1] = torch.empty(base.shape[0], 131, device="cuda", dtype=base.dtype)[:, :128].copy_(base)
    args = (x, weights, starts, counts, biases)
    _check(op(*args), fp64_formula(*args))


def test_k_not_a_multiple_of_8_and_fp32_use_cublas():
    args = _case(5, 12, [20, 9], seed=5)
    _check(op(*args), fp64_formula(*args))
    args32 = _case(5, 64, [20, 9], dtype=torch.float32, seed=6)
    torch.testing.assert_close(op(*args32).double(), fp64_formula(*args32), rtol=1e-4, atol=1e-4)


def test_empty_outputs():
    x, weights, starts, _, biases = _case(4, 64, [8, 8], seed=7)
    assert op(x, weights, starts, [0, 0], biases).shape == (4, 0)
    assert op(x[:0], weights, starts, [8, 8], biases).shape == (0, 16)


def test_more_weights_than_one_launch():
    """70 non-adjacent row ranges (a padding row between weights): two launches, each writing its own columns."""
    counts = [1 + (i * 7) % 23 for i in range(70)]
    for tokens in (3, 33):
        args = _case(tokens, 96, counts, seed=tokens, pad_rows=1, bias=(True, False, False))
        _check(op(*args), fp64_formula(*args))


def _same_shape_case(tokens, *, dtype=torch.bfloat16, seed=0, x_stride_pad=0):
    """Separate weights where row ranges of one shape repeat (batched by cuBLAS), mixed with others that do not, a
    bias that keeps its range out of the batch, and weights with a row stride != K."""
    gen = torch.Generator().manual_seed(seed)
    k = 264
    x = torch.randn(tokens, k + x_stride_pad, generator=gen).to(dtype).cuda()[:, :k]
    weights, starts, counts, biases = [], [], [], []
    for rows, stride, bias in [
        (96, k, False),
        (96, k, False),
        (40, k + 8, False),
        (96, k, True),
        (96, k, False),
        (40, k + 8, False),
        (24, k, False),
        (96, k + 8, False),
        (96, k + 8, False),
    ]:
        weights.append(torch.randn(rows + 2, stride, generator=gen).to(dtype).cuda()[:, :k])
        starts.append(1)
        counts.append(rows)
        biases.append(torch.randn(rows + 2, generator=gen).to(dtype).cuda() if bias else None)
    return x, weights, starts, counts, biases


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 33, 64, 200, 600])
def test_batched_cublas_matches_fp64(tokens, dtype):
    """Row ranges of one shape in one batched GEMM (the op's cuBLAS path, and forced at any T): the same result as
    one GEMM per range, every output column written (the output comes from NaN-filled freed memory)."""
    args = _same_shape_case(tokens, dtype=dtype, seed=tokens, x_stride_pad=8 * (tokens % 2))
    ref = fp64_formula(*args)
    for batched in (True, False):
        torch.full((tokens * 1000 + 1024,), float("nan"), device="cuda", dtype=dtype)  # freed, reused below
        _check(torch.ops.dspark._multi_linear_cublas(*args, batched), ref)
    _check(op(*args), ref)


def _one_element_in(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values, contiguous, one element into a fresh buffer: 2 bytes past a 16-byte boundary for bf16/fp16."""
    buffer = torch.full((t.numel() + 1,), float("nan"), device=t.device, dtype=t.dtype)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 == 2
    return view


@pytest.mark.parametrize("layout", ["contiguous", "column slice"])
@pytest.mark.parametrize("tokens", [16, 64, 200])
def test_batched_cublas_with_a_misaligned_activation(tokens, layout):
    """x 2 bytes past a 16-byte boundary (contiguous, or a column slice from column 1) with row ranges of one shape
    that cuBLAS batches (the op's rule batches them at these T). cuBLAS reads the batched GEMM's pointers from device
    memory, cannot check them and assumes them 16-byte aligned: before, it got x's pointer as it was (a standalone
    batched GEMM of this kind, bf16, T = 16, K = 4096, returned success and a max error of 4.48 on the H200); now
    such an x is copied first. The op and the forced batched path match the formula."""
    k, counts = 4096, [256] * 4
    x, weights, starts, counts, biases = _case(tokens, k, counts, seed=tokens, pad_rows=1, bias=(False,))
    if layout == "contiguous":
        moved = _one_element_in(x)
    else:
        wide = torch.full((tokens, k + 8), float("nan"), device="cuda", dtype=x.dtype)
        wide[:, 1 : 1 + k] = x
        moved = wide[:, 1 : 1 + k]
        assert moved.data_ptr() % 16 == 2
    assert not uses_kernel(tokens, counts) and cublas_batches(counts)
    ref = fp64_formula(x, weights, starts, counts, biases)
    _check(op(moved, weights, starts, counts, biases), ref)
    _check(torch.ops.dspark._multi_linear_cublas(moved, weights, starts, counts, biases, True), ref)


@pytest.mark.parametrize("tokens", [16, 40])
def test_batched_cublas_with_misaligned_weights_and_output_columns(tokens):
    """Ranges of one shape whose weight rows start 2 bytes past a 16-byte boundary (two of four), and ranges whose
    output column block does (three of 64 rows after a range of 3, the output 200 columns wide): before, they went
    into batched GEMMs with those pointers (cuBLAS cannot check pointers it reads from device memory); now each
    takes a GEMM of its own, which cuBLAS checks, and the two aligned weights stay batched (a pointer table is
    written for them, none for the other case). The forced batched path and the op (cuBLAS above 32 tokens) match the
    formula."""
    k = 512
    x, weights, starts, counts, biases = _case(tokens, k, [64] * 4, seed=tokens, pad_rows=0, pad_k=0, bias=(False,))
    weights = [_one_element_in(w) if i % 2 else w for i, w in enumerate(weights)]
    split = _case(tokens, k, [3, 64, 64, 64, 5], seed=tokens + 1, pad_rows=2, bias=(False,))
    for args in ((x, weights, starts, counts, biases), split):
        ref = fp64_formula(*args)
        _check(torch.ops.dspark._multi_linear_cublas(*args, True), ref)
        _check(op(*args), ref)
    tables = _kernel_names(lambda: torch.ops.dspark._multi_linear_cublas(x, weights, starts, counts, biases, True))
    assert any("fill_pointer_table" in n for n in tables)
    assert not any(
        "fill_pointer_table" in n for n in _kernel_names(lambda: torch.ops.dspark._multi_linear_cublas(*split, True))
    )
    assert not cublas_batches([3, 64, 64, 64, 5])


def test_batched_cublas_fewer_kernels_and_more_ranges_than_one_batch():
    """70 ranges of one shape: two batched GEMMs (64 + 6 ranges) and their pointer tables, far fewer kernels than
    one GEMM per range; fp32 is never batched (TF32 and precision follow torch's mm)."""
    x, weights, starts, counts, biases = _case(100, 64, [24] * 70, seed=3, pad_rows=1, bias=(False,))
    args = (x, weights, starts, counts, biases)
    _check(op(*args), fp64_formula(*args))
    batched = _cuda_kernels(lambda: torch.ops.dspark._multi_linear_cublas(*args, True))
    assert batched < _cuda_kernels(lambda: torch.ops.dspark._multi_linear_cublas(*args, False)) // 4
    x32, w32 = x.float(), [w.float() for w in weights]
    torch.testing.assert_close(
        torch.ops.dspark._multi_linear_cublas(x32, w32, starts, counts, biases, True),
        torch.ops.dspark._multi_linear_cublas(x32, w32, starts, counts, biases, False),
    )


def _blocks_case(tokens, counts, *, dtype=torch.bfloat16, seed=0):
    """Separate weights without bias, K = 64, row stride 72 (16-byte aligned rows): the cuBLAS path can batch them."""
    return _case(tokens, 64, counts, dtype=dtype, seed=seed, bias=(False,), pad_rows=1, pad_k=8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [16, 40, 600])
def test_ranges_of_several_shapes_are_one_batched_gemm_of_row_blocks(tokens, dtype):
    """Row counts with a gcd of >= 256 (q/k/v-like 1024 + 256 + 256, and 768 + 256 + 512) are cut into row blocks
    of one height: one batched GEMM, one pointer table, for ranges of three shapes that were a GEMM each (or a GEMM
    and a batched one) before. A gcd below 256 (1024 + 200 + 256: 8) is not."""
    for counts in ([1024, 256, 256], [768, 256, 512]):
        args = _blocks_case(tokens, counts, dtype=dtype, seed=tokens + counts[0])
        assert cublas_batches(counts) and not uses_kernel(tokens, counts)
        names = _kernel_names(lambda a=args: op(*a))
        assert sum("fill_pointer_table" in n for n in names) == 1, names
        ref = fp64_formula(*args)
        torch.full((tokens * 4000 + 1024,), float("nan"), device="cuda", dtype=dtype)  # freed, reused below
        _check(op(*args), ref)
        _check(torch.ops.dspark._multi_linear_cublas(*args, True), ref)
    assert not cublas_batches([1024, 200, 256])
    args = _blocks_case(tokens, [1024, 200, 256], dtype=dtype, seed=tokens)
    assert not any("fill_pointer_table" in n for n in _kernel_names(lambda: op(*args)))
    _check(op(*args), fp64_formula(*args))


def test_row_blocks_of_more_ranges_than_one_table():
    """70 ranges of 2048 and 256 rows in turn: blocks of 256, two batched GEMMs (64 ranges = 288 blocks, more than
    the table kernel's threads, and 6 ranges = 27 blocks), each with its pointer table."""
    counts = [2048 if i % 2 == 0 else 256 for i in range(70)]
    args = _blocks_case(40, counts, seed=7)
    names = _kernel_names(lambda: op(*args))
    assert sum("fill_pointer_table" in n for n in names) == 1  # one kernel name, launched twice
    assert _cuda_kernels(lambda: op(*args)) < 10
    _check(op(*args), fp64_formula(*args))


@pytest.mark.parametrize("misaligned_x", [False, True])
@pytest.mark.parametrize("tokens", [1, 9, 64, 65])
def test_a_single_tall_weight_in_row_blocks(tokens, misaligned_x):
    """A single range of >= 4096 rows without bias, up to 64 tokens: one strided batched GEMM of row blocks (4096:
    two blocks of 2048; 6144: four of 1536), no pointer table, also at decode sizes (not the kernel); from 65 tokens
    one GEMM; a row count that gives no block height (4104) takes the kernel up to 8 tokens, else one GEMM; on an
    sm_90 GPU of 132 SMs (or fewer: 256 to 385 blocks of 16 rows) all three stream up to 8 tokens (one range). All match
    the fp64 formula and the GEMM per range, also when x is not 16-byte aligned (the batched GEMMs read an aligned
    copy)."""
    for rows in (4096, 6144, 4104):
        x, weights, starts, counts, biases = _blocks_case(tokens, [rows], seed=rows + tokens)
        if misaligned_x:
            x = _one_element_in(x)
        args = (x, weights, starts, counts, biases)
        streams = uses_stream(tokens, counts)
        blocks = -(-rows // 16)
        assert streams == (_streams_here() and tokens <= 8 and _sm_count() <= blocks <= 8 * _sm_count())
        kernel = not streams and rows == 4104 and tokens <= kernel_token_threshold()
        assert (streams or uses_kernel(tokens, counts) == kernel) and not cublas_batches(counts)
        names = _kernel_names(lambda a=args: op(*a))
        assert any("multi_linear_kernel" in n for n in names) == kernel
        assert any("multi_linear_stream_kernel" in n for n in names) == streams
        assert not any("fill_pointer_table" in n for n in _kernel_names(lambda a=args: op(*a)))
        ref = fp64_formula(*args)
        _check(op(*args), ref)
        _check(torch.ops.dspark._multi_linear_cublas(*args, False), ref)


@pytest.mark.parametrize("case", ["one shape", "row blocks", "one tall weight", "streamed"])
def test_batched_cublas_in_a_cuda_graph_sees_new_inputs_and_weight_updates(case):
    """A captured call (cuBLAS batched in three forms, or the streaming kernel: K/V of 5 layers at 5 tokens) rewrites
    every output element on replay and reads x and the weights as they are at replay time."""
    if case == "streamed":
        if not _streams_here():
            pytest.skip("the streaming kernel runs the sm_90a code")
        args = _case(5, 512, [2048] * 5, seed=21, pad_rows=1, bias=(False, True))
        assert uses_stream(5, args[3])
    elif case == "one shape":
        args = _same_shape_case(64, seed=5)
    else:
        args = _blocks_case(64, [1024, 256, 512] if case == "row blocks" else [4096], seed=5)
    x, weights = args[0], args[1]
    op(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    if case == "streamed":
        assert any("multi_linear_stream_kernel" in n for n in _kernel_names(graph.replay))
    for step in range(3):
        x.copy_(torch.randn_like(x))
        if step == 2:
            with torch.no_grad():
                weights[0].mul_(-2)
                weights[-1].add_(1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, fp64_formula(*args))


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_a_captured_batched_gemm_reads_a_table_written_once(mode):
    """In a capture the batched GEMM's pointer table is written once (outside the graph) and kept: a replay launches
    no table kernel; a second capture (other output addresses) holds a table of its own; both graphs stay right when
    replayed in any order and after a weight update, and an eager call still writes its table with the kernel and
    keeps none."""
    args = _blocks_case(16, [1024, 256, 512], seed=7)
    x, weights = args[0], args[1]
    assert cublas_batches(args[3]) and not uses_kernel(16, args[3])
    op(*args)
    before = captured_pointer_tables()
    graphs, outs = [], []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            outs.append(op(*args))
        graphs.append(graph)
    assert outs[0].data_ptr() != outs[1].data_ptr()
    after = captured_pointer_tables()
    assert after <= before + 2  # at most one per captured GEMM (an earlier capture of the same addresses shares it)
    replayed = _kernel_names(graphs[0].replay)
    assert any("gemm" in n.lower() or "sm90" in n for n in replayed), replayed
    assert not any("fill_pointer_table" in n for n in replayed)
    for step, order in enumerate([(0, 1), (1, 0), (1, 1, 0)]):
        x.copy_(torch.randn_like(x))
        if step == 2:
            with torch.no_grad():
                weights[1].mul_(-3)
        for out in outs:
            out.fill_(float("nan"))
        for g in order:
            graphs[g].replay()
        torch.cuda.synchronize()
        ref = fp64_formula(*args)
        for out in outs:
            _check(out, ref)
    assert any("fill_pointer_table" in n for n in _kernel_names(lambda: op(*args)))
    _check(op(*args), fp64_formula(*args))
    assert captured_pointer_tables() == after


def _kernel_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize(
    ("tokens", "counts"),
    [
        (8, [256] * 4),
        (16, [256] * 4),
        (16, [512, 128, 128]),
        (16, [128, 256]),
        (40, [128, 256]),
        (40, [256] * 4),
        (8, [1024, 256, 256]),
        (16, [1024, 256, 256]),
    ],
)
def test_the_path_the_rule_names_runs(tokens, counts):
    """The streaming kernel, the tile kernel, a batched GEMM (its pointer-table kernel) or neither, as `uses_stream`
    / `uses_kernel` / `cublas_batches` say (which groups stream depends on the SM count); ranges of one shape are
    batched at every T (600 here)."""
    args = _case(tokens, 256, counts, seed=tokens, pad_rows=1, bias=(False,))
    names = _kernel_names(lambda: op(*args))
    streams = uses_stream(tokens, counts)
    kernel = uses_kernel(tokens, counts) and not streams
    assert any("multi_linear_stream_kernel" in n for n in names) == streams
    assert any("multi_linear_kernel" in n for n in names) == kernel
    assert any("fill_pointer_table" in n for n in names) == (not kernel and cublas_batches(counts))
    many = _case(600, 64, [32] * 3, seed=1, pad_rows=1, bias=(False,))
    assert any("fill_pointer_table" in n for n in _kernel_names(lambda: op(*many)))
    _check(op(*many), fp64_formula(*many))


def _adjacent_case(tokens, seed):
    """Three weights carved out of one packed tensor so that their used rows lie back to back, biases too."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randn(300, 256, generator=gen).to(torch.bfloat16).cuda()
    packed_bias = torch.randn(300, generator=gen).to(torch.bfloat16).cuda()
    weights = [packed[0:120], packed[120:200], packed[200:300]]
    biases = [packed_bias[0:120], packed_bias[120:200], packed_bias[200:300]]
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).cuda()
    return x, weights, [40, 0, 0], [80, 80, 60], biases


def _apart(t):
    """A copy of `t` followed by one unused element, so copies made one after the other are never adjacent."""
    return torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)[: t.numel()].view(t.shape).copy_(t)


def _cuda_kernels(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("tokens", [5, 128])
def test_adjacent_weights_merge(tokens):
    """Back-to-back row ranges are one GEMM / one kernel segment: same result as separate copies of the weights
    (bit-identical on the kernel path), fewer kernels on the cuBLAS path."""
    x, weights, starts, counts, biases = _adjacent_case(tokens, seed=tokens)
    separate = ([_apart(w) for w in weights], [_apart(b) for b in biases])
    merged_out = op(x, weights, starts, counts, biases)
    separate_out = op(x, separate[0], starts, counts, separate[1])
    _check(merged_out, fp64_formula(x, weights, starts, counts, biases))
    if tokens <= kernel_token_threshold():
        assert torch.equal(merged_out, separate_out)
    else:
        torch.testing.assert_close(merged_out, separate_out, rtol=1e-2, atol=1e-2)
        merged = _cuda_kernels(lambda: op(x, weights, starts, counts, biases))
        assert merged < _cuda_kernels(lambda: op(x, separate[0], starts, counts, separate[1]))


@pytest.mark.parametrize("tokens", [16, 64])
def test_partly_adjacent_weights_of_one_shape_stay_one_batched_gemm(tokens):
    """Ten [96, 256] weights, two pairs of them back to back in memory (where an allocator happened to put them):
    merging the pairs would leave runs of two shapes, two batched GEMMs; the op runs the ten as given in one batched
    GEMM, the kernels it launches when no weight is adjacent to another."""
    gen = torch.Generator().manual_seed(tokens)
    packed = [torch.randn(192, 256, generator=gen).to(torch.bfloat16).cuda() for _ in range(2)]
    others = [_apart(torch.randn(96, 256, generator=gen).to(torch.bfloat16).cuda()) for _ in range(6)]
    weights = [packed[0][:96], packed[0][96:], *others[:3], packed[1][:96], packed[1][96:], *others[3:]]
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16).cuda()
    args = (x, weights, [0] * 10, [96] * 10, [None] * 10)
    separate = (x, [_apart(w) for w in weights], *args[2:])
    names = _kernel_names(lambda: op(*args))
    assert sum("fill_pointer_table" in n for n in names) == 1, names
    assert _cuda_kernels(lambda: op(*args)) == _cuda_kernels(lambda: op(*separate)), names
    _check(op(*args), fp64_formula(*args))


@pytest.mark.parametrize("tokens", [4, 64, 100])
def test_cuda_graph_rewrites_every_output_and_sees_weight_updates(tokens):
    """Captured once, replayed: the output buffer is poisoned with NaN before each replay and must be fully
    rewritten; a new activation and an in-place weight update (outside the graph) are both seen."""
    x, weights, starts, counts, biases = _case(tokens, 512, [100, 37, 64], seed=tokens)
    op(x, weights, starts, counts, biases)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, weights, starts, counts, biases)
    for step in range(3):
        x.copy_(torch.randn_like(x))
        if step == 2:
            with torch.no_grad():
                weights[1].mul_(-2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, fp64_formula(x, weights, starts, counts, biases))


def test_every_element_written_on_a_dirty_allocator():
    """The op's output comes from freed NaN-filled blocks of the caching allocator."""
    torch.cuda.synchronize()
    for numel in (1 << 20, 1 << 26):
        torch.full((numel,), float("nan"), device="cuda", dtype=torch.bfloat16)
    for tokens in (1, 16, 64):
        args = _case(tokens, 256, [130, 70], seed=tokens)
        _check(op(*args), fp64_formula(*args))


def test_concurrent_streams():
    """No state is shared between calls: two streams running the op at once get their own results."""
    cases = [_case(16, 1024, [512, 256], seed=s) for s in (8, 9)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = []
    for args, stream in zip(cases, streams, strict=True):
        with torch.cuda.stream(stream):
            outs.append([op(*args) for _ in range(20)])
    torch.cuda.synchronize()
    for args, results in zip(cases, outs, strict=True):
        ref = fp64_formula(*args)
        for out in results:
            _check(out, ref)


def test_compiled_with_symbolic_tokens():
    x0, weights, starts, counts, biases = _case(3, 256, [64, 32], seed=10)

    def fn(x):
        return op(x, weights, starts, counts, biases) * 2

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for tokens in (3, 17, 64, 100):
        x = torch.randn(tokens, 256, device="cuda", dtype=x0.dtype)
        _check(compiled(x) / 2, fp64_formula(x, weights, starts, counts, biases))


@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_opcheck(tokens):
    torch.library.opcheck(op, _case(tokens, 64, [16, 0, 9], seed=tokens))
    torch.library.opcheck(op, _case(tokens, 64, [16, 16, 16], seed=tokens, bias=(False,)))  # batched above 32


def _python_error(args):
    try:
        _check_args(*args)
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    raise AssertionError("custom_ops.linear.multi_linear._check_args accepted the arguments")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda a: a.__setitem__(0, a[0][0]),
        lambda a: a.__setitem__(1, []),
        lambda a: a.__setitem__(2, [3]),
        lambda a: a.__setitem__(3, [16, 13]),
        lambda a: a.__setitem__(3, [16, -2]),
        lambda a: a.__setitem__(0, a[0].int()),
        lambda a: a[1].__setitem__(0, a[1][0].float()),
        lambda a: a[1].__setitem__(1, a[1][1][:, :5]),
        lambda a: a[1].__setitem__(1, a[1][1].cpu()),
        lambda a: a[4].__setitem__(1, a[4][1][:3]),
        lambda a: a[4].__setitem__(1, a[4][1].float()),
        lambda a: a[4].__setitem__(1, a[4][1].cpu()),
    ],
)
def test_errors_match_the_python_checks(mutate):
    """The C++ binding raises the error class and message of `_check_args` (the CPU path's and the fake's checks)."""
    args = list(_case(4, 64, [16, 9], seed=12))
    args[1], args[4] = list(args[1]), list(args[4])
    mutate(args)
    error, message = _python_error(args)
    with pytest.raises(error) as info:
        op(*args)
    assert str(info.value).splitlines()[0] == message


def _stream_variant_of_the_binding() -> int:
    return int(ctypes.CDLL(str(_build.load())).dspark_multi_linear_stream_variant())


def test_variant_op_rejects_what_the_kernel_cannot_run():
    x, weights, starts, counts, biases = _case(4, 64, [16], seed=13)
    with pytest.raises(ValueError, match="variant must be in"):
        variant_op(x, weights, starts, counts, biases, len(kernel_variants()), 0)
    assert _stream_variant_of_the_binding() == STREAM_VARIANT
    with pytest.raises(ValueError, match="variant must be in"):
        variant_op(x, weights, starts, counts, biases, STREAM_VARIANT - 1, 0)
    if _streams_here():
        with pytest.raises(ValueError, match="at most 16 tokens, got 17"):
            variant_op(torch.randn(17, 64, device="cuda", dtype=x.dtype), weights, starts, counts, biases, -2, 0)
        with pytest.raises(ValueError, match="does not split K"):
            variant_op(x, weights, starts, counts, biases, STREAM_VARIANT, 2)
    else:
        with pytest.raises(ValueError, match="needs the sm_90a code"):
            variant_op(x, weights, starts, counts, biases, STREAM_VARIANT, 0)
    with pytest.raises(ValueError, match="split must be in"):
        variant_op(x, weights, starts, counts, biases, 0, 9)
    with pytest.raises(ValueError, match="cannot run this call"):
        variant_op(x.float(), [w.float() for w in weights], starts, counts, [None], 0, 0)
    with pytest.raises(ValueError, match="cannot run this call"):
        variant_op(torch.randn(65, 64, device="cuda", dtype=x.dtype), weights, starts, counts, biases, 0, 0)
