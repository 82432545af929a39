"""Graph verification never calls a graph verified when its real rows are NaN or Inf."""

from __future__ import annotations

import pytest
import torch

from warmcap.graphs.proof.verify import Passes, Tolerance, _check


def _passes(out: torch.Tensor) -> Passes:
    # Replay, padded eager and the unpadded reference agree exactly: only finiteness can fail.
    return Passes(
        num_reqs=1,
        metas={},
        reference=lambda: [out[:2].clone()],
        replay=lambda: [out.clone()],
        padded_eager=lambda: [out.clone()],
        greedy=lambda logits: None,
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_real_rows_are_not_verified(bad):
    out = torch.ones(4, 3)
    out[1, 2] = bad
    check = _check("decode", _passes(out), [], Tolerance(0.0, 1e-5))
    assert not check.verified
    assert "not finite" in check.reason


def test_finite_rows_still_verify_and_nan_padding_is_ignored():
    out = torch.ones(4, 3)
    out[3] = float("nan")  # a padded row (past the 2 real tokens)
    check = _check("decode", _passes(out), [], Tolerance(0.0, 1e-5))
    assert check.verified, check.reason
