"""`benchmarks/dspark_write.py` checks every variant's cache writes at every T of its table, not only at the T its
graph replay is checked at: a variant whose T = 1 graph (or whose graph above `max_fused_rows`) writes wrong values
gets its cells marked, however right its T = 8 graph is."""

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
dspark_write = importlib.import_module("dspark_write")

_, SMALL = dspark_write.SMALL_CONFIGS["small-hd16"]


def _wrong_at_one_token(model):
    """The model's own write, then, for one token only, its first layer's K row at the slot scaled."""

    def call(ctx, positions, cache_loc):
        out = model(ctx, positions, cache_loc)
        if ctx.shape[0] == 1:
            k_cache = model.caches()[0][0]
            k_cache[cache_loc] *= 1.5
        return out

    return call


def _checked(build) -> "dspark_write.Entry":
    base = dspark_write.build_spelling("reference", SMALL, "cpu").requires_grad_(False)
    inputs = {t: dspark_write.make_inputs(SMALL, t, "cpu") for t in (1, dspark_write.PARITY_TOKENS)}
    entry = dspark_write.make_entry(dspark_write.Variant("probe", "probe", build), base)
    with torch.no_grad():
        dspark_write.first_calls([entry], inputs, base)
        dspark_write.check_parity([entry], base, inputs[dspark_write.PARITY_TOKENS], "cpu")
    return entry


def test_a_wrong_write_at_another_t_than_the_replayed_one_is_flagged():
    entry = _checked(_wrong_at_one_token)
    assert entry.wrong and "WRONG" in entry.calls_parity and "(at T = 1)" in entry.calls_parity, entry
    assert "WRONG" not in entry.parity, "the T = 8 check alone passes: only the every-T check can catch it"


def test_a_right_write_passes_at_every_t():
    entry = _checked(lambda model: model)
    assert not entry.wrong and entry.calls_parity.startswith("max error / max |eager| 0.0e+00"), entry
