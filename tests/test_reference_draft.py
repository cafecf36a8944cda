"""The reference draft module against an independent fp64 formula (the parity tests compare to this module)."""

import math

import pytest
import torch
from helpers import draft_inputs, small_config

from dspark_fx.reference_draft import DraftKVConfig, DraftKVWriter


def _fp64_layer(cfg, layer, ctx, positions, eps):
    """Per-layer K/V written from the formulas in the docstring of `dspark_fx/reference_draft.py`, with Python loops
    over the rotated pairs."""
    q, kv = cfg.q_size, cfg.kv_size
    proj = layer.k_proj.weight if cfg.proj == "kv_separate" else layer.qkv_proj.weight[q : q + kv]
    v_proj = layer.v_proj.weight if cfg.proj == "kv_separate" else layer.qkv_proj.weight[q + kv : q + 2 * kv]
    x = ctx.double()
    k = (x @ proj.double().T).view(-1, cfg.num_kv_heads, cfg.head_dim)
    v = (x @ v_proj.double().T).view(-1, cfg.num_kv_heads, cfg.head_dim)
    k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + eps) * layer.k_norm_weight.double()
    rot = cfg.rope_dim
    out = k.clone()
    theta = cfg.rope_theta
    for i in range(rot // 2):
        angle = positions.double()[:, None] * theta ** (-2 * i / rot)
        c, s = torch.cos(angle), torch.sin(angle)
        a, b = (i, i + rot // 2) if cfg.rope_style == "neox" else (2 * i, 2 * i + 1)
        out[..., a] = k[..., a] * c - k[..., b] * s
        out[..., b] = k[..., b] * c + k[..., a] * s
    return out, v


@pytest.mark.parametrize(
    "options",
    [dict(), dict(rope_style="gptj"), dict(rotary_dim=8), dict(proj="kv_separate", rope_style="gptj", rotary_dim=12)],
)
def test_reference_matches_fp64_formula(options):
    cfg = small_config(write="return", **options)
    model = DraftKVWriter(cfg)
    ctx, positions = draft_inputs(cfg, 9)
    with torch.no_grad():
        out = model(ctx, positions)
        for layer, (k, v) in zip(model.layers, out, strict=True):
            k_ref, v_ref = _fp64_layer(cfg, layer, ctx, positions, 1e-6)
            torch.testing.assert_close(k.double(), k_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v.double(), v_ref, rtol=1e-5, atol=1e-5)


def test_commit_writes_only_committed_rows():
    cfg = small_config(write="commit")
    model = DraftKVWriter(cfg)
    poison = float("nan")
    for k_cache, v_cache in model.caches():
        k_cache.fill_(poison)
        v_cache.fill_(poison)
    ctx, positions, loc_2d, commit_lens = draft_inputs(cfg, 12)
    with torch.no_grad():
        model(ctx, positions, loc_2d, commit_lens)
    written = torch.arange(loc_2d.shape[1])[None, :] < commit_lens[:, None]
    for k_cache, v_cache in model.caches():
        for cache in (k_cache, v_cache):
            assert not cache[loc_2d[written]].isnan().any(), "a committed row was not written"
            untouched = torch.ones(cfg.num_slots, dtype=torch.bool)
            untouched[loc_2d[written]] = False
            assert cache[untouched].isnan().all(), "a row outside the committed slots was written"


def test_bad_config():
    with pytest.raises(ValueError, match="proj"):
        DraftKVConfig(proj="fused")
    with pytest.raises(ValueError, match="rotary_dim"):
        DraftKVConfig(head_dim=16, rotary_dim=7)
    with pytest.raises(ValueError, match="eps"):
        DraftKVConfig(num_layers=3, eps=(1e-6, 1e-5))
    assert math.isclose(DraftKVConfig().kv_size, 1024)
