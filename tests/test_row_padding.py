"""`row_padding.remove_row_padding`: the zero rows Inductor's `pad_mm` appends to a GEMM's activation (on CUDA, at a
static token count off the alignment) are undone where the product is sliced back to exactly the original rows, and
nothing else is touched. Graphs traced with fake tensors (no Inductor), each checked on real data against the
function it came from."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from dspark_fx.passes.row_padding import remove_row_padding
from dspark_fx.testing import op_counts


def _padded_mm(x, w):  # pad_mm's form: rows padded to a multiple of 8, the product sliced back
    return torch.mm(F.pad(x, (0, 0, 0, 2)), w)[:-2]


def _padded_addmm(x, w, b):
    return torch.addmm(b, F.pad(x, (0, 0, 0, 2)), w)[:-2]


def _two_gemms_one_pad(x, w, b):
    xp = F.pad(x, (0, 0, 0, 2))
    return torch.mm(xp, w)[:-2], torch.addmm(b, xp, w)[:6]


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(6, 16, generator=gen), torch.randn(16, 24, generator=gen), torch.randn(24, generator=gen)


def _trace(fn, args):
    return make_fx(fn, tracing_mode="fake")(*args)


@pytest.mark.parametrize(
    ("fn", "gemms"),
    [(_padded_mm, 1), (_padded_addmm, 1), (_two_gemms_one_pad, 2)],
    ids=["mm", "addmm", "one-pad-two-gemms"],
)
def test_zero_rows_sliced_off_are_undone(fn, gemms):
    args = _inputs()[: fn.__code__.co_argcount]
    gm = _trace(fn, args)
    assert op_counts(gm.graph)["aten.constant_pad_nd"] == 1
    assert remove_row_padding(gm.graph) == gemms
    gm.graph.lint()
    gm.recompile()
    counts = op_counts(gm.graph)
    assert counts["aten.constant_pad_nd"] == 0 and counts["aten.slice"] == 0, gm.code
    for target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        assert all(n.meta["val"].shape[0] == 6 for n in gm.graph.find_nodes(op="call_function", target=target))
    torch.testing.assert_close(gm(*args), fn(*args))


def _not_the_first_rows(x, w):
    return torch.mm(F.pad(x, (0, 0, 0, 2)), w)[1:7]


def _padded_k(x, w):  # K padded too: the weight would need padding, not this form
    return torch.mm(F.pad(x, (0, 2, 0, 2)), F.pad(w, (0, 0, 0, 2)))[:-2]


def _nonzero_pad(x, w):
    return torch.mm(F.pad(x, (0, 0, 0, 2), value=1.0), w)[:-2]


def _product_read_whole(x, w):
    y = torch.mm(F.pad(x, (0, 0, 0, 2)), w)
    return y[:-2], y.sum()


def _two_row_bias(x, w, b):
    return torch.addmm(b.expand(8, -1).contiguous(), F.pad(x, (0, 0, 0, 2)), w)[:-2]


@pytest.mark.parametrize(
    "fn",
    [_not_the_first_rows, _padded_k, _nonzero_pad, _product_read_whole, _two_row_bias],
    ids=["rows-1-to-7", "k-padded", "pad-value-1", "product-read-whole", "bias-with-padded-rows"],
)
def test_other_paddings_and_slices_are_left_alone(fn):
    args = _inputs()[: fn.__code__.co_argcount]
    gm = _trace(fn, args)
    before = str(gm.graph)
    assert remove_row_padding(gm.graph) == 0
    assert str(gm.graph) == before


def test_the_form_inductors_pad_mm_emits_is_undone():
    """Inductor's own `pad_mm` replacement, applied to a CPU graph (its device and Triton checks patched to pass,
    `force_shape_pad` so that it pads without timing): the rows it appends are undone and the GEMMs read `x` again.
    This fails if Inductor changes the form it emits."""
    from unittest import mock

    import torch._inductor.fx_passes.pad_mm as pad_mm
    from torch._inductor.fx_passes import joint_graph

    def gemms(x, w, b):
        return torch.mm(x, w), torch.addmm(b, x, w)

    args = _inputs()
    gm = _trace(gemms, args)
    with (
        mock.patch.object(pad_mm, "check_device", lambda a, b: True),
        mock.patch.object(pad_mm, "has_triton", lambda: True),
        torch._inductor.config.patch(force_shape_pad=True),
    ):
        pad_mm._pad_mm_init(torch.device("cpu"))
        assert joint_graph.patterns.apply(gm.graph) == 2
    assert op_counts(gm.graph)["aten.constant_pad_nd"] == 2, "pad_mm padded the rows"
    assert remove_row_padding(gm.graph) == 2
    gm.graph.lint()
    gm.recompile()
    assert not any(n.target is torch.ops.aten.constant_pad_nd.default for n in gm.graph.nodes), gm.code
    torch.testing.assert_close(gm(*args), gemms(*args))
