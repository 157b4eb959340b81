"""The benchmark's FLOP accounting (useful work counts only unmasked pairs)."""

import pytest

from bench import suite


@pytest.mark.parametrize(
    ("mask", "kept"),
    [
        ("none", lambda T, w: T * T),
        ("causal", lambda T, w: T * (T + 1) // 2),
        ("window", lambda T, w: sum(min(t, w) + 1 for t in range(T))),
        ("global", lambda T, w: sum(min(t, w) + 1 for t in range(T)) + sum(1 for t in range(T) if t > w)),
    ],
)
def test_density_counts_exactly_the_attended_pairs(mask, kept):
    case = suite.Case(B=2, N=3, T=37, D=8, mask=mask, window=5)
    assert case.density() == pytest.approx(kept(37, 5) / 37**2)
    assert case.flops() == pytest.approx(4 * 2 * 3 * 37 * 37 * 8 * case.density())
    assert suite.Case(2, 3, 37, 8, mask, "fwdbwd", 5).flops() == pytest.approx(3.5 * case.flops())
