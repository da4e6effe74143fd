"""Issue 19 #7: integer arguments outside the Trainer go through ``torchrig.arguments.int_in_range``
(one message style: ``name=value must be an int >= low`` / ``must be an int, not <type>``)."""

from __future__ import annotations

import pytest
from torch import nn

import torchrig
from torchrig.arguments import ArgumentTypeError, int_in_range


def test_a_wrong_type_is_a_type_error_that_callers_catching_value_error_still_catch() -> None:
    with pytest.raises(ArgumentTypeError, match=r"^n='3' must be an int, not str$") as err:
        int_in_range("n", "3", 1)
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)
    with pytest.raises(ValueError, match=r"^n=0 must be an int >= 1$") as low:
        int_in_range("n", 0, 1)
    assert not isinstance(low.value, TypeError)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"num_nodes=0 must be an int >= 1 \(the number of machines\)"),
        (True, r"num_nodes=True must be an int, not bool \(the number of machines\)"),
        ("2", r"num_nodes='2' must be an int, not str \(the number of machines\)"),
    ],
)
def test_num_nodes_is_an_int_of_at_least_one(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        torchrig.Rig(accelerator="cpu", num_nodes=value)  # type: ignore[arg-type]


def test_plan_world_size_is_an_int_of_at_least_one() -> None:
    with pytest.raises(ValueError, match=r"world_size=0 must be an int >= 1 \(devices x num_nodes\)"):
        torchrig.plan(lambda: nn.Linear(2, 2), world_size=0)
    with pytest.raises(TypeError, match=r"world_size=2.0 must be an int, not float \(devices x num_nodes\)"):
        torchrig.plan(lambda: nn.Linear(2, 2), world_size=2.0)  # type: ignore[arg-type]
