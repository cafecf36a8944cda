"""The pass installed as Inductor's custom pass when a model is exported and compiled ahead of time
(`torch.export` + `torch._inductor.aoti_compile_and_package`), on the CPU: the draft's caches, registered buffers,
are graph constants there (`get_attr`), written in place by the lowered op across calls of the package; and with
grad mode on while the package compiles, the writes keep their path with a reason instead of failing the compile."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from helpers import draft_inputs, poison_caches, small_config

from dspark_fx import DsparkConfig
from dspark_fx.passes.manager import DsparkPassManager
from dspark_fx.reference_draft import DraftKVWriter
from dspark_fx.report import KVKeptReason

pytestmark = [
    pytest.mark.slow,  # Inductor's C++ codegen and a package build per test
    pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="needs a C++ compiler"),
]

ALWAYS = DsparkConfig(fuse_on_cpu=True, kv_write_op="always")


class _ReadsOldRowsThenWrites(torch.nn.Module):
    """The draft writer, first returning a sum of every cache's rows at `read_loc`: a later call reads the rows an
    earlier one wrote, so the package's outputs show whether it wrote its own cache constants."""

    def __init__(self, writer: DraftKVWriter) -> None:
        super().__init__()
        self.writer = writer

    def forward(self, ctx, positions, loc, read_loc):
        old = sum(cache[read_loc].sum(dim=(1, 2)) for pair in self.writer.caches() for cache in pair)
        self.writer(ctx, positions, loc)
        return old


def _package(model: torch.nn.Module, args: tuple, tmp_path, manager: DsparkPassManager):
    ep = torch.export.export(model, args)
    with torch._inductor.config.patch(post_grad_custom_post_pass=manager):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    return torch._inductor.aoti_load_package(path)


def _calls(runner, eager: torch.nn.Module, cfg, slots: torch.Tensor) -> None:
    """Three calls of the package and of eager, each reading rows the one before wrote: the same outputs."""
    for step in range(3):
        ctx, positions, _ = draft_inputs(cfg, 5, seed=10 + step)
        loc, read = slots[5 * step : 5 * step + 5], slots[5 * step - 5 : 5 * step] if step else slots[-5:]
        with torch.no_grad():
            torch.testing.assert_close(runner(ctx, positions, loc, read), eager(ctx, positions, loc, read))


def _models(cfg) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    writer = DraftKVWriter(cfg)
    poison_caches(writer)
    slots = torch.randperm(cfg.num_slots, generator=torch.Generator().manual_seed(2))
    return _ReadsOldRowsThenWrites(writer), _ReadsOldRowsThenWrites(copy.deepcopy(writer)), slots


def test_buffer_caches_lower_in_a_package_and_each_call_writes_them(tmp_path):
    """The caches are the package's constants: the pass lowers their writes (it once looked only at graph inputs,
    so they were neither lowered nor reported), and the package's calls give eager's outputs."""
    cfg = small_config(write="cache_loc", num_slots=32)
    model, eager, slots = _models(cfg)
    manager = DsparkPassManager(ALWAYS)
    with torch.no_grad():
        runner = _package(model, (*draft_inputs(cfg, 5), slots[:5]), tmp_path, manager)
    _calls(runner, eager, cfg, slots)
    (report,) = manager.reports
    assert [len(w.layers) for w in report.kv_writes] == [cfg.num_layers] and not report.kv_kept, str(report)


def test_a_package_compiled_with_grad_on_keeps_the_writes_and_says_how_to_lower_them(tmp_path):
    """Exported and compiled with grad mode on (no `torch.no_grad()` anywhere): Inductor runs the lowered op on
    the parameters, which require grad, and the op's autograd check failed the compile. The writes keep their path,
    the report names the constant and `torch.no_grad()`, and the package's calls give eager's outputs."""
    cfg = small_config(write="cache_loc", num_slots=32)
    model, eager, slots = _models(cfg)
    manager = DsparkPassManager(ALWAYS)
    runner = _package(model, (*draft_inputs(cfg, 5), slots[:5]), tmp_path, manager)
    _calls(runner, eager, cfg, slots)
    (report,) = manager.reports
    assert not report.kv_writes, str(report)
    (kept,) = report.kv_kept
    assert kept.reason is KVKeptReason.OP_REFUSES and "requires grad" in kept.detail, str(report)
    assert "torch.no_grad()" in kept.detail, str(report)
