"""The backend object: validated settings at `make_backend` time, nothing kept per compile."""

import gc

import pytest
import torch
from torch import nn

import dspark_fx
from dspark_fx import DsparkConfig, make_backend
from dspark_fx.backend import DsparkBackend
from dspark_fx.passes.manager import DsparkPassManager
from dspark_fx.testing import CaptureBackend, assert_close_for_dtype


class _Three(nn.Module):
    """Three GEMMs on one input: one fused group."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x):
        return [lin(x).relu() for lin in self.lins]


def _compile_and_run(backend, width: int = 16):
    model = _Three(width)
    x = torch.randn(4, width)
    with torch.no_grad():
        assert_close_for_dtype(torch.compile(model, backend=backend)(x), model(x))


def _container_sizes(obj) -> dict[str, int]:
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (list, dict, set, tuple))}


def _live_managers() -> int:
    gc.collect()
    return sum(type(o) is DsparkPassManager for o in gc.get_objects())


def test_backends_keep_nothing_per_compile():
    """A server that compiles again and again must not accumulate pass managers in the backend."""
    torch._dynamo.reset()
    backend = make_backend(inner="aot_eager")
    sizes = _container_sizes(backend)
    for width in (8, 16, 24):  # three graphs
        _compile_and_run(backend, width)
    assert _container_sizes(backend) == sizes
    torch._dynamo.reset()
    assert _live_managers() == 0, "a pass manager outlived the compiled code that used it"


def test_default_backend_is_a_stateless_backend_object():
    assert isinstance(dspark_fx.backend._DEFAULT, DsparkBackend)
    assert _container_sizes(dspark_fx.backend._DEFAULT) == {}
    assert isinstance(make_backend(), DsparkBackend)


def test_make_backend_accepts_a_dict_of_config_fields():
    torch._dynamo.reset()
    backend = make_backend({"min_branches": 3, "batch_regions": False}, inner="aot_eager")
    assert backend.config == DsparkConfig(min_branches=3, batch_regions=False)
    _compile_and_run(backend)
    capture = CaptureBackend({"min_branches": 4})
    _compile_and_run(capture)
    capture.assert_fused(n_groups=0)
    assert DsparkPassManager({"skinny_linears": False}).config == DsparkConfig(skinny_linears=False)


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ({"min_branch": 2}, ValueError, r"make_backend: config has unknown field\(s\) \['min_branch'\]"),
        ({"min_branches": 1}, ValueError, r"make_backend: config: DsparkConfig.min_branches must be >= 2"),
        ({"min_branches": "2"}, TypeError, r"make_backend: config: DsparkConfig.min_branches must be int, got str"),
        ({"batch_regions": 1}, TypeError, r"DsparkConfig.batch_regions must be bool, got int"),
        (5, TypeError, r"make_backend: config must be a DsparkConfig, a dict of its fields or None, got int"),
        ("min_branches=2", TypeError, r"make_backend: config must be .*, got str"),
    ],
)
def test_make_backend_rejects_a_wrong_config_at_call_time(config, error, match):
    with pytest.raises(error, match=match):
        make_backend(config)


def test_other_arguments_are_checked_at_call_time():
    with pytest.raises(ValueError, match="make_backend: inner must be one of"):
        make_backend(inner="eager")
    with pytest.raises(TypeError, match="make_backend: observer must be callable"):
        make_backend(observer=[])
    with pytest.raises(TypeError, match="CaptureBackend: config must be"):
        CaptureBackend(3)
    with pytest.raises(TypeError, match="explain: config must be"):
        dspark_fx.explain(_Three(), torch.randn(2, 16), config=3)
    with pytest.raises(TypeError, match=r"DsparkConfig\.max_leaf_numel must be int"):
        DsparkConfig(max_leaf_numel=2.5)
