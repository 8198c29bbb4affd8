"""attr_engine_kernels.validate: the shared scalar checks refuse bools, strings and non-finite values, naming the
argument."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attr_engine_kernels.validate import check_bool, check_int, check_int_at_least, check_non_negative, check_positive


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "0.5", None, [1.0]])
def test_check_positive_refuses_non_positive_non_finite_and_non_numbers(bad) -> None:
    with pytest.raises(ValueError, match="tau must be a positive finite number"):
        check_positive(bad, "tau")


def test_check_positive_and_non_negative_return_floats() -> None:
    assert check_positive(2, "tau") == 2.0 and isinstance(check_positive(2, "tau"), float)
    assert check_positive(np.float32(0.5), "tau") == 0.5  # numpy scalars are numbers
    assert check_non_negative(0, "w") == 0.0 and isinstance(check_non_negative(0, "w"), float)


@pytest.mark.parametrize("bad", [-1e-9, math.inf, math.nan, False, "1"])
def test_check_non_negative_refuses_negative_non_finite_and_non_numbers(bad) -> None:
    with pytest.raises(ValueError, match="weight must be a finite number >= 0"):
        check_non_negative(bad, "weight")


def test_integer_and_bool_checks() -> None:
    assert check_int(-3, "seed") == -3 and check_int_at_least(2, "n", 2) == 2
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ValueError, match="seed must be an integer"):
            check_int(bad, "seed")
    with pytest.raises(ValueError, match="n must be an integer >= 2, got 1"):
        check_int_at_least(1, "n", 2)
    assert check_bool(False, "amp") is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(ValueError, match="amp must be a bool"):
            check_bool(bad, "amp")
