"""Hostile values shared by the targets: what a careless or malicious caller passes."""

from __future__ import annotations

import math

from hypothesis import strategies as st

# (10**5000, whose repr raises, is in tests/test_params.py: hypothesis could not report it.)
huge_ints = st.sampled_from([2**31, 2**63, 2**64, 2**70, 2**1100, -(2**63)])
odd_numbers = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-40, 1e308, 5e-324])
hostile = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.integers(),
    huge_ints,
    st.floats(),
    odd_numbers,
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.lists(st.one_of(st.integers(0, 3), st.lists(st.integers(0, 3), max_size=2)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(object()),
    st.binary(max_size=4),
)


def plausible_or_hostile(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly (4 in 5) values of the right kind, so the valid space is explored too; else
    anything."""
    return st.one_of(plausible, plausible, plausible, plausible, hostile)
