"""`DsparkConfig(colocate_weights=True)`: the backend moves the weights of linears sharing an activation into one
allocation, back to back in graph order, after it compiled the graph (dspark_fx/colocate.py). On CPU it acts only
with `fuse_on_cpu=True`, the devices where GEMM groups fuse."""

import pytest
import torch
from helpers import draft_inputs, small_config
from torch import nn

import dspark_fx
from dspark_fx import make_backend
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.testing import CaptureBackend

ON = {"colocate_weights": True, "fuse_on_cpu": True}


class KV(nn.Module):
    """`layers` (k, v) linears on `x`, and one more linear on `y`."""

    def __init__(self, layers: int = 3, bias: bool | list[bool] = False, width: int = 16) -> None:
        super().__init__()
        biases = bias if isinstance(bias, list) else [bias] * (2 * layers)
        self.k = nn.ModuleList(nn.Linear(width, 8, bias=biases[2 * i]) for i in range(layers))
        self.v = nn.ModuleList(nn.Linear(width, 8, bias=biases[2 * i + 1]) for i in range(layers))
        self.other = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kv = [torch.cat([k(x), v(x)], -1) for k, v in zip(self.k, self.v, strict=True)]
        return torch.cat([*kv, self.other(y)], -1)

    def graph_order(self) -> list[torch.Tensor]:
        return [w for k, v in zip(self.k, self.v, strict=True) for w in (k.weight, v.weight)]


def _storages(tensors) -> list[tuple[int, int]]:
    return [(t.untyped_storage().data_ptr(), t.storage_offset()) for t in tensors]


def _back_to_back(tensors) -> bool:
    first = tensors[0].untyped_storage().data_ptr()
    offset = 0
    for t in tensors:
        if t.untyped_storage().data_ptr() != first or t.storage_offset() != offset:
            return False
        offset += t.numel()
    return True


def _compile_and_call(model, backend, *args):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        return compiled, compiled(*args)


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_weights_move_back_to_back_in_graph_order_and_stay_live(inner, inputs):
    torch.manual_seed(0)
    model = KV()
    values = [w.detach().clone() for w in model.graph_order()]
    objects = [id(w) for w in model.graph_order()]
    other = _storages([model.other.weight])
    with torch.no_grad():
        expected = model(*inputs)
    counters = torch._dynamo.utils.counters["dspark_fx"]
    before = counters["weight_groups_colocated"]
    compiled, out = _compile_and_call(model, make_backend(ON, inner=inner), *inputs)
    torch.testing.assert_close(out, expected)
    assert counters["weight_groups_colocated"] == before + 1
    weights = model.graph_order()
    assert [id(w) for w in weights] == objects  # the same Parameter objects, now views of one allocation
    assert _back_to_back(weights)
    assert all(isinstance(w, nn.Parameter) and w.requires_grad for w in weights)
    for w, value in zip(weights, values, strict=True):
        assert torch.equal(w, value)
    assert _storages([model.other.weight]) == other  # a lone linear is not a group
    # the compiled graph reads the new allocation: an in-place update is seen, with no recompile
    with torch.no_grad():
        model.k[1].weight.mul_(-2.0)
        model.v[2].weight.add_(1.0)
        expected = model(*inputs)
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.testing.assert_close(compiled(*inputs), expected)


def test_off_by_default(inputs):
    model = KV()
    storages = _storages(model.graph_order())
    _compile_and_call(model, make_backend({"fuse_on_cpu": True}, inner="aot_eager"), *inputs)
    assert _storages(model.graph_order()) == storages


def test_report_says_what_moved_and_a_second_compile_finds_them_in_place(inputs):
    model = KV()
    capture = CaptureBackend(config=ON, inner="aot_eager")
    _compile_and_call(model, capture, *inputs)
    (group,) = capture.report.colocated
    assert group.moved and group.activation == "x"
    assert group.weights == ["k.0.weight", "v.0.weight", "k.1.weight", "v.1.weight", "k.2.weight", "v.2.weight"]
    assert "moved into one allocation" in str(capture.report)
    capture = CaptureBackend(config=ON, inner="aot_eager")
    _compile_and_call(model, capture, *inputs)
    (group,) = capture.report.colocated
    assert not group.movable and group.reason == "already back to back"


@pytest.mark.parametrize("holder", ["state_dict", "dlpack"])
def test_a_weight_shared_with_another_tensor_is_left_where_it_is(inputs, holder):
    """A `state_dict()` kept from before holds views of the weights, a DLPack export (a weight handed to another
    library; `to_dlpack` takes a parameter that requires grad) holds the weight itself: moving them would leave the
    holder reading the old memory (stale values; after a DLPack export, memory the move freed)."""
    model = KV()
    if holder == "state_dict":
        kept = model.state_dict()
    else:
        kept = {"k.0.weight": torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(model.k[0].weight))}
    storages = _storages(model.graph_order())
    capture = CaptureBackend(config=ON, inner="aot_eager")
    _compile_and_call(model, capture, *inputs)
    assert _storages(model.graph_order()) == storages
    (group,) = capture.report.colocated
    reason = "shares its storage with another tensor" if holder == "state_dict" else "held by more than its Python"
    assert not group.moved and reason in group.reason, group.reason
    with torch.no_grad():
        model.k[0].weight.mul_(3.0)
    assert torch.equal(kept["k.0.weight"], model.k[0].weight)


@pytest.mark.parametrize("memory", ["shared", "numpy"])
def test_weights_in_memory_held_outside_are_left_where_they_are(inputs, memory):
    """A weight in shared memory (`share_memory_()`, e.g. a Hogwild model) or in a numpy array: moving it would give
    this process a private copy, which the other side's updates no longer reach."""
    model = KV()
    arrays = []
    with torch.no_grad():
        for layer in model.k:
            if memory == "shared":
                layer.weight.share_memory_()
            else:
                arrays.append(layer.weight.detach().numpy().copy())
                layer.weight = nn.Parameter(torch.from_numpy(arrays[-1]))
    storages = _storages(model.graph_order())
    capture = CaptureBackend(config=ON, inner="aot_eager")
    compiled, _ = _compile_and_call(model, capture, *inputs)
    assert _storages(model.graph_order()) == storages
    (group,) = capture.report.colocated
    assert not group.moved and "shared with another process or owned outside torch" in group.reason
    if arrays:
        arrays[0] *= -1.0  # written through numpy, as another owner would
    else:
        with torch.no_grad():
            model.k[0].weight.neg_()  # the shared storage another process would write
    with torch.no_grad():
        assert torch.equal(compiled(*inputs), model(*inputs))


def test_biases_move_with_their_weights(inputs):
    model = KV(bias=True)
    _compile_and_call(model, make_backend(ON, inner="aot_eager"), *inputs)
    assert _back_to_back(model.graph_order())
    assert _back_to_back([b for k, v in zip(model.k, model.v, strict=True) for b in (k.bias, v.bias)])


@pytest.mark.parametrize(
    ("model", "config", "reason"),
    [
        (lambda: KV(bias=[True, False, True, True, True, True]), ON, "some linears have a bias and some do not"),
        (lambda: KV(width=2), ON, "a weight row is not a multiple of 16 bytes"),
    ],
)
def test_groups_left_as_they_are_say_why(model, config, reason):
    module = model()
    width = module.other.in_features
    args = (torch.randn(3, width), torch.randn(3, width))
    storages = _storages(module.graph_order())
    capture = CaptureBackend(config=config, inner="aot_eager")
    _compile_and_call(module, capture, *args)
    assert [g.reason for g in capture.report.colocated] == [reason]
    assert _storages(module.graph_order()) == storages


def test_cpu_weights_stay_without_fuse_on_cpu(monkeypatch, inputs):
    from dspark_fx.passes import horizontal

    monkeypatch.setattr(horizontal, "GROUP_GEMM_DEVICES", ("cuda",))  # the default (tests/conftest.py widens it)
    model = KV()
    storages = _storages(model.graph_order())
    capture = CaptureBackend(config={"colocate_weights": True}, inner="aot_eager")
    _compile_and_call(model, capture, *inputs)
    (group,) = capture.report.colocated
    assert group.reason == "the weights are on cpu, where the pass does not fuse GEMM groups"
    assert _storages(model.graph_order()) == storages


def test_inference_tensors_are_left_where_they_are(inputs):
    with torch.inference_mode():
        model = KV()
    storages = _storages(model.graph_order())
    capture = CaptureBackend(config=ON, inner="aot_eager")
    with torch.inference_mode():
        torch._dynamo.reset()
        torch.compile(model, backend=capture)(*inputs)
    assert "inference tensor" in capture.report.colocated[0].reason
    assert _storages(model.graph_order()) == storages


class SharedWeight(nn.Module):
    """k_proj and v_proj on the context and, with q_proj, on the block: a weight in two groups (a DFlash layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 32, bias=False)
        self.k = nn.Linear(16, 8, bias=False)
        self.v = nn.Linear(16, 8, bias=False)

    def forward(self, block: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(block), self.k(block), self.v(block), self.k(ctx), self.v(ctx)], -1)


def test_a_weight_in_two_groups_goes_to_the_larger(inputs):
    model = SharedWeight()
    capture = CaptureBackend(config=ON, inner="aot_eager")
    with torch.no_grad():
        expected = model(*inputs)
    _, out = _compile_and_call(model, capture, *inputs)
    torch.testing.assert_close(out, expected)
    block, ctx = capture.report.colocated
    assert block.moved and block.weights == ["q.weight", "k.weight", "v.weight"]
    # the context's k and v are back to back inside the block's allocation (before the move: "also in a larger group")
    assert not ctx.moved and ctx.reason == "already back to back"
    assert _back_to_back([model.q.weight, model.k.weight, model.v.weight])


def test_explain_names_the_larger_group_that_would_take_a_shared_weight(inputs):
    report = dspark_fx.explain(SharedWeight(), *inputs, config=ON)
    block, ctx = report.colocated
    assert block.movable and not block.moved
    assert not ctx.movable and ctx.reason == "a weight or bias is also in a larger group, which takes it"


def test_a_parameter_replaced_after_the_move_is_read(inputs):
    model = KV()
    compiled, _ = _compile_and_call(model, make_backend(ON, inner="aot_eager"), *inputs)
    model.v[1].weight = nn.Parameter(torch.randn(8, 16))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))


def test_explain_reports_what_would_move_and_moves_nothing(inputs):
    model = KV()
    storages = _storages(model.graph_order())
    report = dspark_fx.explain(model, *inputs, config=ON)
    (group,) = report.colocated
    assert group.movable and not group.moved
    assert "would move into one allocation" in str(report)
    assert _storages(model.graph_order()) == storages


def test_the_lowered_kv_write_reads_moved_weights():
    """The draft's K/V weights (separate k_proj / v_proj) move, and the op's fp32 reference (kv_write_op="always")
    writes the caches an unmoved copy writes."""
    cfg = small_config(proj="kv_separate", num_layers=3)
    config = {**ON, "kv_write_op": "always"}
    moved, plain = DraftKVWriter(cfg), DraftKVWriter(cfg)
    plain.load_state_dict(moved.state_dict())
    args = draft_inputs(cfg, 6)
    capture = CaptureBackend(config=config, inner="aot_eager")
    _compile_and_call(moved, capture, *args)
    _compile_and_call(plain, make_backend({"fuse_on_cpu": True, "kv_write_op": "always"}, inner="aot_eager"), *args)
    assert len(capture.report.kv_writes) == 1 and capture.report.colocated[0].moved
    assert _back_to_back([w for layer in moved.layers for w in (layer.k_proj.weight, layer.v_proj.weight)])
    for (k_m, v_m), (k_p, v_p) in zip(moved.caches(), plain.caches(), strict=True):
        torch.testing.assert_close(k_m, k_p)
        torch.testing.assert_close(v_m, v_p)


def test_a_training_graph_reports_the_group_once_and_its_gradients_are_eager_ones(inputs):
    """With grad enabled the compile makes a forward and a backward graph (the pass runs on both); the weights move
    after it, and the gradients through the moved parameters are eager's."""
    torch.manual_seed(0)
    model, reference = KV(), KV()
    reference.load_state_dict(model.state_dict())
    capture = CaptureBackend(config=ON, inner="aot_eager")
    torch._dynamo.reset()
    torch.compile(model, backend=capture)(*inputs).square().sum().backward()
    reference(*inputs).square().sum().backward()
    assert len(capture.reports) == 2 and [g.moved for g in capture.report.colocated] == [True]
    assert _back_to_back(model.graph_order())
    for moved, plain in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(moved.grad, plain.grad)


def test_weights_moved_at_a_call_under_inference_mode_stay_normal_tensors(inputs):
    """Servers call the model (and so compile it) under `torch.inference_mode()`: the new allocation is made outside
    it, so the parameters can still be updated in place (a weight reload) and used with autograd afterwards."""
    model = KV()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_backend(ON, inner="aot_eager"))
    with torch.inference_mode():
        compiled(*inputs)
    assert _back_to_back(model.graph_order())
    assert not any(w.is_inference() for w in model.graph_order())
    with torch.no_grad():
        model.k[0].weight.mul_(2.0)
        expected = model(*inputs)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(*inputs), expected)


def test_a_move_made_in_inference_mode_makes_no_inference_tensors():
    """`colocate_weights` itself, called in inference mode (the backend is reached from Dynamo, which leaves it),
    allocates outside it."""
    from dspark_fx.colocate import WeightGroup, colocate_weights

    weights = [nn.Parameter(torch.randn(8, 16)) for _ in range(3)]
    with torch.inference_mode():
        (group,) = colocate_weights([WeightGroup("x", ["a", "b", "c"], weights, [None] * 3)], ("cpu",))
    assert group.moved and _back_to_back(weights)
    assert not any(w.is_inference() for w in weights)
    with torch.no_grad():
        weights[1].add_(1.0)
