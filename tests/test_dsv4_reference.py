"""Checks of the fp64 ground truth `gt_compress` (tests/dsv4_cases.py) on cases with a known answer."""

from __future__ import annotations

import pytest
import torch
from dsv4_cases import gt_compress


def test_gt_uniform_scores_give_the_window_mean():
    d = 128
    kvs = torch.randn(256, 2 * d)
    kvs[:, d:] = 0.5
    gt = gt_compress(kvs, torch.zeros(128, d), 128)
    torch.testing.assert_close(gt, kvs[:, :d].double().reshape(2, 128, d).mean(1))


def test_gt_c4_first_window_ignores_the_overlap_half():
    d = 128
    kvs = torch.randn(8, 4 * d)
    ape = torch.randn(8, d)
    gt = gt_compress(kvs, ape, 4)
    w = torch.softmax(kvs[:4, 3 * d :].double() + ape[4:].double(), 0)
    torch.testing.assert_close(gt[0], (w * kvs[:4, d : 2 * d].double()).sum(0))
    changed = kvs.clone()
    changed[:4, 0:d] += 1.0
    assert torch.equal(gt_compress(changed, ape, 4)[0], gt[0])
    assert not torch.equal(gt_compress(changed, ape, 4)[1], gt[1])


@pytest.mark.parametrize("ratio", [4, 128])
def test_gt_dominant_score_selects_one_slot(ratio):
    d = 128
    window = 8 if ratio == 4 else 128
    kvs = torch.randn(2 * ratio, (4 if ratio == 4 else 2) * d)
    ape = torch.zeros(window, d)
    ape[window - 1] = 200.0  # the last slot (the window's last token, fresh half) dominates
    gt = gt_compress(kvs, ape, ratio)
    last = kvs[2 * ratio - 1, d : 2 * d] if ratio == 4 else kvs[2 * ratio - 1, :d]
    torch.testing.assert_close(gt[1], last.double())
