"""The tensor-parallel reference draft's configuration and helpers refuse what cannot be split (instead of
dropping heads), and the draft step takes a step with no context tokens (the multi-process runs:
tests/test_tensor_parallel.py)."""

import pytest
import torch

from dspark_fx.reference_tp_draft import TPDraft, TPDraftConfig, rank_heads


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, r"num_heads = 6 must be a multiple of num_kv_heads = 4"),
        ({"num_kv_heads": 0}, r"TPDraftConfig\.num_kv_heads must be a positive int, got 0"),
        ({"head_dim": 8.0}, r"TPDraftConfig\.head_dim must be a positive int, got 8\.0"),
        ({"max_position": -1}, r"TPDraftConfig\.max_position must be a positive int"),
    ],
)
def test_config_refuses_sizes_no_draft_can_have(fields, says):
    with pytest.raises(ValueError, match=says):
        TPDraftConfig(**fields)


@pytest.mark.parametrize(
    ("world_size", "rank", "says"),
    [
        (3, 0, r"num_heads = 8 does not split over 3 ranks"),
        (0, 0, r"world_size must be a positive int, got 0"),
        (-1, 0, r"world_size must be a positive int, got -1"),
        (2, 2, r"rank must be an int in \[0, 2\), got 2"),
        (2, -1, r"rank must be an int in \[0, 2\), got -1"),
    ],
)
def test_rank_heads_refuses_what_does_not_split(world_size, rank, says):
    with pytest.raises(ValueError, match=says):
        rank_heads(TPDraftConfig(), rank, world_size)


def test_rank_heads_tile_the_kv_heads():
    cfg = TPDraftConfig(num_heads=8, num_kv_heads=4)
    assert [rank_heads(cfg, r, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]
    assert [rank_heads(cfg, r, 4) for r in range(4)] == [slice(r, r + 1) for r in range(4)]


def test_a_step_with_no_context_tokens_writes_nothing_and_runs_the_block():
    cfg = TPDraftConfig()
    model = TPDraft(cfg)
    none, hidden = torch.randn(0, cfg.hidden), torch.randn(4, cfg.hidden)
    with torch.no_grad():
        out = model(none, torch.arange(0), torch.arange(0), hidden, torch.arange(4))
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    assert not any(torch.count_nonzero(t) for kv in model.caches() for t in kv)
