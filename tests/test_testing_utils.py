"""The helpers that choose a CPU run's cases (tests/testing_utils.py): what each keeps, and that the full matrix
keeps everything."""

import itertools

import pytest

import testing_utils
from testing_utils import covering, cpu_subset, share


@pytest.fixture(params=[False, True], ids=["cpu", "full_matrix"])
def full_matrix(request, monkeypatch):
    monkeypatch.setattr(testing_utils, "FULL_MATRIX", request.param)
    return request.param


def test_covering_takes_every_value_of_every_axis(full_matrix):
    axes = (["a", "b", "c", "d", "e"], [1, 2], ["x", "y", "z"])
    cases = covering(*axes)
    if full_matrix:
        assert cases == list(itertools.product(*axes))
    else:
        assert len(cases) == 5
        assert cases[:3] == [("a", 1, "x"), ("b", 2, "y"), ("c", 1, "z")]
    for position, axis in enumerate(axes):
        assert {case[position] for case in cases} == set(axis)


def test_shares_of_consecutive_indices_hold_every_case_once(full_matrix):
    cases = list(range(11))
    shares = [share(cases, index, 3) for index in range(7, 10)]
    if full_matrix:
        assert all(part == cases for part in shares)
    else:
        assert sorted(itertools.chain(*shares)) == cases
        assert share(cases, 7, 3) == share(cases, 1, 3) == [1, 4, 7, 10]


def test_cpu_subset_keeps_the_named_cases_in_their_order(full_matrix):
    cases = [("fused", "bfloat16"), ("split", "bfloat16"), ("fused", "float16")]
    kept = cpu_subset(iter(cases), [("fused", "float16"), ("fused", "bfloat16")])
    assert kept == (cases if full_matrix else [("fused", "bfloat16"), ("fused", "float16")])


def test_cpu_subset_refuses_a_case_it_does_not_hold():
    with pytest.raises(AssertionError, match="split"):
        cpu_subset(["fused"], ["split"])
