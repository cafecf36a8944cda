"""K/V cache writes through a view of the cache (`dspark_fx/passes/kv_write.py`): a paged `[pages, page, heads,
head_dim]` cache written as `[pages * page, heads, head_dim]` rows, HF's static cache `[1, heads, S, head_dim]`
written along its slot dim (`index_copy_(2, loc, k)`), and several caches in one buffer (the layers stacked in
`[L, S, heads, head_dim]`, K and V of a layer in vLLM's `[2, pages, page, heads, head_dim]`, taken by index or by
`unbind(0)`, or interleaved per slot in `[S, 2, heads, head_dim]`). They lower to one `multi_linear_kv_write` that
writes a view of each cache placeholder (no copy), with eager's caches; writes of projections in other forms keep
today's path with a `WRITE_FORM` reason naming the cache."""

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import mark_tokens_dynamic, quick_first
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from dspark_fx import DsparkConfig, explain
from dspark_fx.passes import kv_write
from dspark_fx.passes.graph_utils import op_name
from dspark_fx.report import KVKeptReason
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype, op_counts

OP = "dspark.multi_linear_kv_write"
ALWAYS = DsparkConfig(kv_write_op="always")
LAYERS, HIDDEN, HEADS, HEAD_DIM, PAGES, PAGE, POSITIONS = 3, 64, 2, 16, 16, 4, 512
SLOTS = PAGES * PAGE
VIEWS = (
    "aten.view",
    "aten.reshape",
    "aten._unsafe_view",
    "aten.select",
    "aten.permute",
    "aten.squeeze",
    "aten.unsqueeze",
)
CACHE_SHAPES = {
    "paged_view": (PAGES, PAGE, HEADS, HEAD_DIM),  # cache.view(-1, h, d)[loc] = k
    "paged_flatten_index_copy": (PAGES, PAGE, HEADS, HEAD_DIM),  # cache.flatten(0, 1).index_copy_(0, loc, k)
    "paged_flat_view": (PAGES, PAGE, HEADS * HEAD_DIM),  # cache.view(-1, h * d)[loc] = k.flatten(1)
    "hf_static": (1, HEADS, SLOTS, HEAD_DIM),  # HF StaticCache: cache.index_copy_(2, loc, k[None])
    "heads_first_index": (HEADS, SLOTS, HEAD_DIM),  # cache[:, loc] = k.transpose(0, 1)
    "page_offset": (PAGES, PAGE, HEADS, HEAD_DIM),  # cache[loc // page, loc % page] = k: the op writes view(-1, h, d)
    "hf_static_batch_2": (2, HEADS, SLOTS, HEAD_DIM),  # two batch rows, each written the same K
    "scatter_heads_apart": (SLOTS, HEADS, HEAD_DIM),  # cache.scatter_(0, loc + head, k): head j to slot loc + j
    "heads_first_transposed": (HEADS, SLOTS, HEAD_DIM),  # cache.transpose(0, 1)[loc] = k
    "accumulate": (SLOTS, HEADS, HEAD_DIM),  # cache.index_put_((loc,), k, accumulate=True): adds, not a write
    "scatter_multiply": (SLOTS, HEADS, HEAD_DIM),  # cache.scatter_(0, loc, k, reduce="multiply"): multiplies
    "written_twice": (SLOTS, HEADS, HEAD_DIM),  # cache[loc] = 0, then cache[loc] = k
    "read_after": (SLOTS, HEADS, HEAD_DIM),  # cache[loc] = k, and the forward returns cache[loc] read back
}
KEPT = ("hf_static_batch_2", "scatter_heads_apart", "heads_first_transposed", "accumulate")
KEPT += ("scatter_multiply",)
KEPT += ("written_twice",)
KEPT += ("read_after",)
BUFFERS = {  # several caches in one buffer: how each layer's K and V caches are taken, and how they are written
    "stacked": "index",  # k_cache [L, S, h, d]: k_cache[i][loc] = k
    "vllm_kv": "paged_view",  # kv_cache_i [2, pages, page, h, d]: kv_cache_i[0].view(-1, h, d)[loc] = k
    "stacked_unbind": "index",  # k_cache.unbind(0)[i][loc] = k
    "vllm_kv_unbind": "paged_view",  # key_cache, value_cache = kv_cache_i.unbind(0), as vLLM takes them
    # kv_cache_i [S, 2, h, d]: kv_cache_i[:, 0][loc] = k (K and V interleaved per slot; kv_cache_i[loc, 0] = k traces
    # to the same select and index_put)
    "interleaved": "index",
    "interleaved_unbind": "index",  # k_cache, v_cache = kv_cache_i.unbind(1)
}
LOWERED = [w for w in CACHE_SHAPES if w not in KEPT] + list(BUFFERS)


def _write(cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, how: str) -> None:
    """`k [T, heads, head_dim]` into `cache` at slots `loc`, as `how` says."""
    if how == "index":
        cache[loc] = k
    elif how == "paged_view":
        cache.view(-1, HEADS, HEAD_DIM)[loc] = k
    elif how == "paged_flatten_index_copy":
        cache.flatten(0, 1).index_copy_(0, loc, k)
    elif how == "paged_flat_view":
        cache.view(-1, HEADS * HEAD_DIM)[loc] = k.flatten(1)
    elif how == "hf_static":
        cache.index_copy_(2, loc, k.transpose(0, 1)[None])
    elif how == "heads_first_index":
        cache[:, loc] = k.transpose(0, 1)
    elif how == "page_offset":
        cache[loc // PAGE, loc % PAGE] = k
    elif how == "scatter_heads_apart":
        heads = torch.arange(k.shape[1], device=loc.device)[None, :, None]
        cache.scatter_(0, (loc[:, None, None] + heads).remainder(cache.shape[0]).expand_as(k), k)
    elif how == "heads_first_transposed":
        cache.transpose(0, 1)[loc] = k
    elif how == "accumulate":
        cache.index_put_((loc,), k, accumulate=True)
    elif how == "scatter_multiply":
        cache.scatter_(0, loc[:, None, None].expand_as(k), k, reduce="multiply")
    elif how == "written_twice":
        cache[loc] = torch.zeros_like(k)
        cache[loc] = k
    elif how == "read_after":
        cache[loc] = k
    else:
        cache.index_copy_(2, loc, k.transpose(0, 1)[None].expand(2, -1, -1, -1))


class CacheViewWriter(nn.Module):
    """Per layer: fused kv linear (bias) split into K and V, an HF RMSNorm of K per head, neox RoPE from the rows
    of an fp32 `[cos | sin]` table; K and V written into caches of `CACHE_SHAPES[how]` (random values: slots not
    written must keep them)."""

    def __init__(self, how: str, dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.how = how
        self.kv = nn.ModuleList(nn.Linear(HIDDEN, 2 * HEADS * HEAD_DIM) for _ in range(LAYERS))
        self.norm_weights = nn.ParameterList(nn.Parameter(torch.rand(HEAD_DIM) + 0.5) for _ in range(LAYERS))
        angles = torch.outer(torch.arange(POSITIONS).float(), 1e4 ** -(torch.arange(0, HEAD_DIM, 2) / HEAD_DIM))
        self.register_buffer("cos_sin", torch.cat((angles.cos(), angles.sin()), dim=-1))
        for name, shape in _buffer_shapes(how).items():
            self.register_buffer(name, torch.randn(shape, generator=gen).to(dtype))
        self.kv.to(dtype)
        self.norm_weights.to(dtype)

    def caches(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in _buffer_shapes(self.how)]

    def layer_caches(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`'s K and V caches (views of a buffer of several caches)."""
        if self.how == "stacked":
            return self.k_cache[i], self.v_cache[i]
        if self.how == "stacked_one_slice":  # every layer into slice 0: the last one's values stay
            return self.k_cache[0], self.v_cache[0]
        if self.how == "stacked_two_inputs":
            return self.k_cache[i], self.v_cache[i]
        if self.how == "stacked_unbind":
            return self.k_cache.unbind(0)[i], self.v_cache.unbind(0)[i]
        if self.how == "vllm_kv":
            kv = getattr(self, f"kv_cache_{i}")
            return kv[0], kv[1]
        if self.how == "vllm_kv_unbind":
            return getattr(self, f"kv_cache_{i}").unbind(0)
        if self.how == "interleaved":
            kv = getattr(self, f"kv_cache_{i}")
            return kv[:, 0], kv[:, 1]
        if self.how == "interleaved_unbind":
            return getattr(self, f"kv_cache_{i}").unbind(1)
        return getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor) -> torch.Tensor | None:
        cos, sin = self.cos_sin.index_select(0, positions).chunk(2, dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        for i, proj in enumerate(self.kv):
            # "stacked_two_inputs": layer 1 projects another activation, into the same buffers as the others
            k, v = proj(x.flip(0) if self.how == "stacked_two_inputs" and i == 1 else x).split(HEADS * HEAD_DIM, dim=-1)
            k = k.view(-1, HEADS, HEAD_DIM).float()
            k = (k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.norm_weights[i]
            k1, k2 = k.float().chunk(2, dim=-1)
            k = torch.cat((k1 * cos - k2 * sin, k2 * cos + k1 * sin), dim=-1).to(x.dtype)
            k_cache, v_cache = self.layer_caches(i)
            how = BUFFERS.get(self.how, "index" if self.how.startswith("stacked_") else self.how)
            _write(k_cache, loc, k, how)
            _write(v_cache, loc, v.view(-1, HEADS, HEAD_DIM), how)
        return self.k_cache_0[loc].sum() if self.how == "read_after" else None


def _buffer_shapes(how: str) -> dict[str, tuple[int, ...]]:
    if how.startswith("stacked"):
        return {f"{kind}_cache": (LAYERS, SLOTS, HEADS, HEAD_DIM) for kind in "kv"}
    if how.startswith("vllm_kv"):
        return {f"kv_cache_{i}": (2, PAGES, PAGE, HEADS, HEAD_DIM) for i in range(LAYERS)}
    if how.startswith("interleaved"):
        return {f"kv_cache_{i}": (SLOTS, 2, HEADS, HEAD_DIM) for i in range(LAYERS)}
    return {f"{kind}_cache_{i}": CACHE_SHAPES[how] for i in range(LAYERS) for kind in "kv"}


def _run(how: str, dtype: torch.dtype, inner: str = "aot_eager", device: str = "cpu", config=ALWAYS) -> CaptureBackend:
    """Eager against compiled at T = 6 (marked dynamic), 1 and 9 (fresh random inputs, distinct slots); the
    capture of the compiles."""
    torch._dynamo.reset()
    eager = CacheViewWriter(how, dtype).to(device)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(config, inner=inner)
    compiled = torch.compile(model, backend=capture)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for step, tokens in enumerate((6, 1, 9)):
            args = (
                torch.randn(tokens, HIDDEN, generator=gen).to(dtype),
                torch.randint(0, POSITIONS, (tokens,), generator=gen),
                torch.randperm(SLOTS, generator=gen)[:tokens],
            )
            args = tuple(a.to(device) for a in args)
            if step == 0:
                mark_tokens_dynamic(args)
            eager(*args)
            compiled(*args)
            assert_close_for_dtype(model.caches(), eager.caches())
    return capture


def _cache_of(node: torch.fx.Node) -> torch.fx.Node:
    """The placeholder a chain of views starts from."""
    while node.op != "placeholder":
        assert op_name(node) in VIEWS, f"{node} is not a view of the cache"
        node = node.args[0]
    return node


def _assert_lowered_into_views(capture: CaptureBackend) -> None:
    """Every graph holds one op writing all layers, no write of its own left, and the op's caches are distinct
    views of the cache placeholders."""
    assert capture.after, "nothing compiled"
    for graph, report in zip(capture.after, capture.reports, strict=True):
        counts = op_counts(graph)
        assert counts[OP] == 1 and not counts["aten.index_put"] and not counts["aten.copy_"], f"{report}\n{graph}"
        (op,) = [n for n in graph.nodes if n.target is kv_write.KV_WRITE]
        caches = op.args[12] + op.args[13]
        assert len(set(caches)) == 2 * LAYERS and all(_cache_of(c).op == "placeholder" for c in caches), caches
        assert not counts["aten.select_scatter"] and not counts["aten.slice_scatter"], str(graph)
        (group,) = report.kv_writes
        assert len(group.layers) == LAYERS, str(report)


@pytest.mark.parametrize("dtype", quick_first(1, [torch.float32, torch.bfloat16]), ids=["fp32", "bf16"])
@pytest.mark.parametrize("how", quick_first(2, LOWERED))
def test_writes_through_a_view_of_the_cache_lower(how, dtype):
    _assert_lowered_into_views(_run(how, dtype))


@pytest.mark.slow
@pytest.mark.parametrize(
    "how", ["paged_view", "page_offset", "hf_static", "stacked", "vllm_kv", "vllm_kv_unbind", "interleaved"]
)
def test_writes_through_a_view_compile_through_inductor(how):
    """Inductor's codegen of the op writing views of graph inputs: eager's caches."""
    _assert_lowered_into_views(_run(how, torch.bfloat16, inner="inductor"))


@pytest.mark.parametrize(
    "how",
    quick_first(
        2,
        [
            "stacked_two_inputs",
            "hf_static_batch_2",
            "stacked_one_slice",
            "scatter_heads_apart",
            "heads_first_transposed",
            "accumulate",
            "scatter_multiply",
            "written_twice",
        ],
    ),
)
def test_other_write_forms_keep_todays_path_and_say_why(how):
    """One K written to two batch rows, every layer written to the same slice of a stacked buffer, the layers of
    one buffer projecting two activations (the buffer's writes lower together or not at all), a `scatter_` of each
    head to a slot of its own, a write through a transposed view, an `index_put_` that adds (`accumulate=True`), a
    `scatter_` that multiplies (`reduce="multiply"`, which the pass once did not count as a write, so the report
    said nothing) or two writes into one cache: no view of the cache is the op's `[S, heads, head_dim]` (or the
    writes overwrite each other, or belong to two ops, or add); eager's caches, and a `WRITE_FORM` reason per buffer
    naming it."""
    capture = _run(how, torch.float32)
    report = capture.report
    assert not report.kv_writes and all(op_counts(g)[OP] == 0 for g in capture.after)
    kept = [k for k in report.kv_kept if k.reason is KVKeptReason.WRITE_FORM]
    assert len(kept) == len(report.kv_kept), str(report)
    shapes = _buffer_shapes(how)
    assert {k.cache for k in kept} == set(shapes), str(report)
    assert all(f"{list(shapes[k.cache])}: the op writes rows at one slot per token" in k.detail for k in kept)
    assert all(("with accumulate=True" in k.detail) == (how == "accumulate") for k in kept), str(report)
    assert all(k.detail.startswith("2 writes into one cache") == (how == "written_twice") for k in kept), str(report)


def test_two_index_paged_writes_count_negative_slots_from_the_end_as_eager_does():
    """`cache[loc // page, loc % page] = k` with negative slots (page `pages + loc // page`, offset `loc % page`:
    slot `S + loc`): the op writes `cache.view(-1, h, d)` at `loc` counting from the end too; eager's caches."""
    torch._dynamo.reset()
    eager = CacheViewWriter("page_offset", torch.float32)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    gen = torch.Generator().manual_seed(3)
    loc = torch.tensor([-1, -SLOTS, -PAGE - 1, 5, SLOTS - PAGE])
    args = (torch.randn(5, HIDDEN, generator=gen), torch.randint(0, POSITIONS, (5,), generator=gen), loc)
    with torch.no_grad():
        eager(*args)
        torch.compile(model, backend=capture)(*args)
    assert op_counts(capture.after[0])[OP] == 1, str(capture.report)
    assert_close_for_dtype(model.caches(), eager.caches())


def test_a_cache_read_after_its_write_keeps_that_write_and_says_so():
    """The forward returns rows of layer 0's K cache read back after the write: that cache's write stays, with a
    `CACHE_READ_AFTER` reason naming it, and so does layer 0's V (no K left to pair it with); the other layers
    lower."""
    capture = _run("read_after", torch.float32)
    for graph_report in capture.reports:
        assert [len(w.layers) for w in graph_report.kv_writes] == [LAYERS - 1], str(graph_report)
        assert {k.cache for k in graph_report.kv_kept} == {"k_cache_0", "v_cache_0"}, str(graph_report)
    report = capture.report
    kept = [k for k in report.kv_kept if k.cache == "k_cache_0"]  # one per graph
    assert kept and all(k.reason is KVKeptReason.CACHE_READ_AFTER for k in kept), str(report)
    assert all(re.fullmatch(r"k_cache_0 is read by \w+ \(aten\.index\) after a write to it", k.detail) for k in kept)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "how", ["paged_view", "paged_flat_view", "page_offset", "hf_static", "stacked", "vllm_kv", "interleaved"]
)
def test_writes_through_a_view_lower_on_cuda_with_auto(how):
    """The default `kv_write_op="auto"` on CUDA (bf16, real Inductor codegen, the op's CUDA kernel writing the
    views): eager's caches."""
    _assert_lowered_into_views(_run(how, torch.bfloat16, inner="inductor", device="cuda", config=DsparkConfig()))


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_a_reshape_of_the_cache_is_its_view_only_where_no_copy_is_made(transposed):
    """Inductor's post-grad graphs spell views as reshapes; a reshape that must copy (of a cache whose strides
    allow no view) would give the op a copy to write, so the pass takes it for the cache only where it is an
    alias."""
    graph = torch.fx.Graph()
    cache = graph.placeholder("cache")
    target = graph.call_function(torch.ops.aten.reshape.default, (cache, [-1, HEADS, HEAD_DIM]))
    with FakeTensorMode():
        val = (
            torch.empty(PAGE, PAGES, HEADS, HEAD_DIM).transpose(0, 1)
            if transposed
            else torch.empty(CACHE_SHAPES["paged_view"])
        )
        cache.meta["val"], target.meta["val"] = val, val.reshape(-1, HEADS, HEAD_DIM)
    assert kv_write._aliases(cache, target) is not transposed


@pytest.mark.parametrize("how", ["paged_view", "hf_static", "stacked", "vllm_kv"])
def test_nodes_without_a_value_are_not_read_as_writes_through_views(how):
    """A user pass may leave nodes without `meta["val"]`: finding the writes through views skips them (no
    exception), and with the values back the same graph has a site per cache."""
    torch._dynamo.reset()
    capture = CaptureBackend(DsparkConfig(kv_write_op="never"))
    with torch.no_grad():
        args = (torch.randn(6, HIDDEN), torch.randint(0, POSITIONS, (6,)), torch.randperm(SLOTS)[:6])
        torch.compile(CacheViewWriter(how, torch.float32), backend=capture)(*args)
    graph = capture.before[0]
    stripped = {n: n.meta.pop("val") for n in graph.nodes if n.op == "call_function" and "val" in n.meta}
    sites, _ = kv_write._find_sites(graph)
    assert not sites
    for node, val in stripped.items():
        node.meta["val"] = val
    sites, _ = kv_write._find_sites(graph)
    assert len(sites) == 2 * LAYERS


def test_two_index_writes_into_pages_apart_keep_their_path():
    """FlashInfer's NHD layout, `kv [pages, 2, page, h, d]` and `k_cache = kv[:, 0]` passed in: the pages of one
    cache are not back to back, so there is no `[S, h, d]` view for the op to write; the two-index write keeps its
    path (it once raised out of the pass) and eager's caches."""

    class Writer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
            self.v = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)

        def forward(self, x, loc, k_cache, v_cache):
            k_cache[loc // PAGE, loc % PAGE] = F.rms_norm(self.k(x).view(-1, HEADS, HEAD_DIM), (HEAD_DIM,), eps=1e-6)
            v_cache[loc // PAGE, loc % PAGE] = self.v(x).view(-1, HEADS, HEAD_DIM)

    torch._dynamo.reset()
    model = Writer()
    caches = [torch.randn(PAGES, 2, PAGE, HEADS, HEAD_DIM)[:, i] for i in (0, 1)]
    expected = [c.clone() for c in caches]
    x, loc = torch.randn(3, HIDDEN), torch.tensor([0, 5, PAGES * PAGE - 1])
    capture = CaptureBackend(ALWAYS)
    with torch.no_grad():
        model(x, loc, *expected)
        torch.compile(model, backend=capture)(x, loc, *caches)
    assert_close_for_dtype(caches, expected)
    assert not capture.report.kv_writes, str(capture.report)


class _OneBufferPassedIn(nn.Module):
    """A layer's K and V in one buffer passed in, `[2, S, h, d]` (`dim=0`) or `[S, 2, h, d]` (`dim=1`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.k, self.v = (nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False) for _ in range(2))

    def forward(self, x: torch.Tensor, loc: torch.Tensor, kv: torch.Tensor) -> None:
        kv.select(self.dim, 0)[loc] = F.rms_norm(self.k(x).view(-1, HEADS, HEAD_DIM), (HEAD_DIM,), eps=1e-6)
        kv.select(self.dim, 1)[loc] = self.v(x).view(-1, HEADS, HEAD_DIM)


@pytest.mark.parametrize("dim", [0, 1])
def test_one_buffer_passed_in_with_symbolic_sizes_keeps_its_writes(dim):
    """Under `dynamic=True` the buffer's dims are symbolic (Dynamo specializes only sizes 0 and 1), so the index of
    each half cannot be normalised: the writes keep their path with a reason and eager's values (the pass raised
    `unhashable type: non-nested SymInt` out of the compile)."""
    torch._dynamo.reset()
    model = _OneBufferPassedIn(dim)
    capture = CaptureBackend(ALWAYS)
    shape = (2, SLOTS, HEADS, HEAD_DIM) if dim == 0 else (SLOTS, 2, HEADS, HEAD_DIM)
    kv = torch.randn(shape)
    expected = kv.clone()
    x, loc = torch.randn(5, HIDDEN), torch.randperm(SLOTS)[:5]
    with torch.no_grad():
        model(x, loc, expected)
        torch.compile(model, backend=capture, dynamic=True)(x, loc, kv)
    assert_close_for_dtype(kv, expected)
    kept = capture.report.kv_kept
    assert kept and all(k.reason is KVKeptReason.WRITE_FORM for k in kept), str(capture.report)


def test_a_chain_node_without_a_value_keeps_the_writes():
    """A user post-grad pass (it runs first) that rebuilds the first `select_scatter` of a `[2, S, h, d]` buffer's
    chain without `meta["val"]`, as hand-written passes often do: the writes keep their path, the pass does not raise
    (it read that node's rank)."""

    def rebuild_first_select_scatter(graph: torch.fx.Graph) -> None:
        first = next(n for n in graph.nodes if n.target is torch.ops.aten.select_scatter.default)
        with graph.inserting_after(first):
            rebuilt = graph.call_function(torch.ops.aten.select_scatter.default, first.args)
        first.replace_all_uses_with(rebuilt)
        graph.erase_node(first)

    torch._dynamo.reset()
    eager = CacheViewWriter("vllm_kv", torch.float32)
    model = copy.deepcopy(eager)
    capture = CaptureBackend(ALWAYS)
    args = (torch.randn(4, HIDDEN), torch.randint(0, POSITIONS, (4,)), torch.randperm(SLOTS)[:4])
    with torch.no_grad(), torch._inductor.config.patch(post_grad_custom_post_pass=rebuild_first_select_scatter):
        eager(*args)
        torch.compile(model, backend=capture)(*args)
    assert_close_for_dtype(model.caches(), eager.caches())
    assert capture.report.kv_kept, str(capture.report)


class _ReadsItsRowsThenWrites(nn.Module):
    """K and V of every layer in one `[L, S, h, d]` buffer each; a layer reads its own old rows (as attention over
    the cache before the write would), then writes its new rows."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 2, head_dim: int = 16, slots: int = 64):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.heads, self.head_dim = heads, head_dim
        self.kv = nn.ModuleList(nn.Linear(hidden, 2 * heads * head_dim) for _ in range(layers))
        self.register_buffer("k_cache", torch.randn(layers, slots, heads, head_dim, generator=gen))
        self.register_buffer("v_cache", torch.randn(layers, slots, heads, head_dim, generator=gen))

    def forward(self, x, loc, read_loc):
        total = 0
        for i, proj in enumerate(self.kv):
            total = total + self.k_cache[i][read_loc] * 2
            k, v = proj(x).view(-1, 2, self.heads, self.head_dim).unbind(1)
            self.k_cache[i][loc] = k
            self.v_cache[i][loc] = v
        return total


@pytest.mark.slow  # Inductor codegen
def test_a_stacked_cache_read_in_the_graph_keeps_its_writes_under_inductor():
    """Lowered, the op wrote the layers' views in place while Inductor emitted the read of the old rows (a pointwise
    load of the same buffer) after it, so the output held the new rows (max error 11 against eager). The writes stay
    (VIEW_READ) and the output and caches are eager's."""
    model = _ReadsItsRowsThenWrites()
    eager = copy.deepcopy(model)
    capture = CaptureBackend({"fuse_on_cpu": True, "kv_write_op": "always"}, inner="inductor")
    compiled = torch.compile(model, backend=capture)
    gen = torch.Generator().manual_seed(5)
    x, perm = torch.randn(5, 64, generator=gen), torch.randperm(64, generator=gen)
    with torch.no_grad():
        got, want = compiled(x, perm[:5], perm[:5].flip(0)), eager(x, perm[:5], perm[:5].flip(0))
    assert_close_for_dtype((got, *model.buffers()), (want, *eager.buffers()))
    assert [k.reason for k in capture.report.kv_kept] == [KVKeptReason.VIEW_READ], str(capture.report)


def test_interleaved_caches_passed_in_with_a_symbolic_slot_count_lower_in_explain_as_in_inductor():
    """Interleaved `[S, 2, h, d]` caches passed in, `S` marked dynamic, written as `kv[:, 0][loc] = k`: without
    Inductor (aot_eager, and so `explain`) the graph keeps the whole-range `slice`/`slice_scatter` of `kv[:, 0]`
    between the links of each buffer's `select_scatter` chain, which Inductor's post-grad clean-up removes before
    the pass runs; the pass removes them too, so explain reports the writes Inductor lowers (it said `WRITE_FORM`),
    and both give eager's caches."""

    class Writer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kv = nn.ModuleList(nn.Linear(HIDDEN, 2 * HEADS * HEAD_DIM, bias=False) for _ in range(2))

        def forward(self, x: torch.Tensor, loc: torch.Tensor, kvs: list[torch.Tensor]) -> None:
            for proj, kv in zip(self.kv, kvs, strict=True):
                k, v = proj(x).view(-1, 2, HEADS, HEAD_DIM).unbind(1)
                kv[:, 0][loc] = F.rms_norm(k, (HEAD_DIM,), eps=1e-6)
                kv[:, 1][loc] = v

    model = Writer()
    gen = torch.Generator().manual_seed(5)
    x, loc = torch.randn(5, HIDDEN, generator=gen), torch.randperm(SLOTS, generator=gen)[:5]
    kvs = [torch.randn(SLOTS, 2, HEADS, HEAD_DIM, generator=gen) for _ in range(2)]
    expected = [kv.clone() for kv in kvs]

    def marked():
        out = [kv.clone() for kv in kvs]
        for kv in out:
            torch._dynamo.mark_dynamic(kv, 0)
        return out

    with torch.no_grad():
        model(x, loc, expected)
        report = explain(model, x, loc, marked(), config=ALWAYS)
        assert [len(w.layers) for w in report.kv_writes] == [1, 1] and not report.kv_kept, str(report)
        for inner in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            capture = CaptureBackend(ALWAYS, inner=inner)
            caches = marked()
            torch.compile(model, backend=capture)(x, loc, caches)
            assert_close_for_dtype(caches, expected)
            assert [len(w.layers) for w in capture.report.kv_writes] == [1, 1], f"{inner}: {capture.report}"
            assert not capture.report.kv_kept, f"{inner}: {capture.report}"
