"""``devices=`` parsing: every accepted form, every error by its message, and a fuzz."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchrig
from torchrig import CPUAccelerator
from torchrig.devices import normalize_devices, parse_process_count, select_indices

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (1, 1),
        (3, 3),
        (-1, -1),
        ("auto", -1),
        (" AUTO ", -1),
        ("2", 2),
        ("-1", -1),
        ("0,1", [0, 1]),
        ("1,", [1]),
        (" 0 , 2 ", [0, 2]),
        ("2,0", [2, 0]),
        ([0, 1], [0, 1]),
        ((1,), [1]),
        ([np.int64(1), 3], [1, 3]),
    ],
)
def test_normalize_accepts(devices: Any, expected: Any) -> None:
    assert normalize_devices(devices) == expected


FORMS = "use a positive count (devices=2), -1 or 'auto' for all, an index string ('0,1' or '1,'), or a list of indices"


@pytest.mark.parametrize(
    ("devices", "error", "message"),
    [
        (0, ValueError, "devices=0 asks for no device; use a positive count such as devices=1, or -1 for all"),
        ("0", ValueError, "devices='0' asks for no device"),
        ([], ValueError, "devices=[] is empty; list at least one index, such as [0]"),
        ((), ValueError, "devices=() is empty"),
        (-2, ValueError, "devices=-2 is negative; the only negative value allowed is -1 (all)"),
        ("-3", ValueError, "devices='-3' is negative; the only negative value allowed is -1 (all)"),
        ([-1], ValueError, "devices=[-1] holds negative indices [-1]; indices start at 0"),
        ("0,-1", ValueError, "devices='0,-1' holds negative indices [-1]; indices start at 0"),
        (True, TypeError, f"devices=True is a bool; {FORMS}"),
        (False, TypeError, "devices=False is a bool"),
        ([0, 0], ValueError, "devices=[0, 0] repeats index 0; each device can be used once: devices=[0]"),
        ("1,2,1", ValueError, "devices='1,2,1' repeats index 1; each device can be used once: devices=[1, 2]"),
        ([0, 1.5], TypeError, "devices=[0, 1.5] holds 1.5 (float); indices must be ints such as [0, 1]"),
        ([True], TypeError, "devices=[True] holds True (a bool); indices must be ints"),
        (["0"], TypeError, "devices=['0'] holds '0' (str); indices must be ints"),
        (1.5, TypeError, f"devices=1.5 has type float; {FORMS}"),
        (2.0, TypeError, "devices=2.0 has type float"),
        (None, TypeError, "devices=None has type NoneType"),
        ({0: 1}, TypeError, "devices={0: 1} has type dict"),
        ("abc", ValueError, f"devices='abc' is not a number or a list of indices; {FORMS}"),
        ("1.5", ValueError, "devices='1.5' is not a number or a list of indices"),
        ("", ValueError, "devices='' is not a number or a list of indices"),
        ("0,x", ValueError, "devices='0,x' is not a number or a list of indices"),
        ("²", ValueError, "devices='²' is not a number"),
        (",", ValueError, "devices=',' names no device index"),
    ],
)
def test_normalize_rejects_with_a_message(devices: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as err:
        normalize_devices(devices)
    assert str(err.value).startswith(message), str(err.value)


def test_select_indices_against_the_machine() -> None:
    assert select_indices(2, device_type="cuda", available=4) == [0, 1]
    assert select_indices(-1, device_type="cuda", available=3) == [0, 1, 2]
    assert select_indices("auto", device_type="cuda", available=2) == [0, 1]
    assert select_indices("1,", device_type="cuda", available=2) == [1]
    assert select_indices([1, 0], device_type="cuda", available=2) == [1, 0]


def test_select_indices_out_of_range_message_is_exact() -> None:
    with pytest.raises(ValueError) as err:
        select_indices([3], device_type="cuda", available=2)
    assert str(err.value) == "devices=[3] asks for cuda:3, but this machine has 2 cuda devices: [0, 1]"
    with pytest.raises(ValueError) as err:
        select_indices("1,", device_type="xpu", available=1)
    assert str(err.value) == "devices='1,' asks for xpu:1, but this machine has 1 xpu device: [0]"
    with pytest.raises(ValueError) as err:
        select_indices([0, 4, 5], device_type="cuda", available=2)
    assert str(err.value).startswith("devices=[0, 4, 5] asks for cuda:4, cuda:5, but this machine has 2")


def test_select_indices_count_too_large_and_none_available() -> None:
    with pytest.raises(ValueError) as err:
        select_indices(3, device_type="cuda", available=2)
    assert str(err.value) == (
        "devices=3 asks for 3 cuda devices, but this machine has 2: [0, 1]; use devices=2 or devices=-1"
    )
    with pytest.raises(ValueError) as err:
        select_indices(1, device_type="mps", available=0)
    assert str(err.value) == (
        "devices=1 asks for mps devices, but this machine has none; use accelerator='cpu' or accelerator='auto'"
    )


def test_cpu_devices_is_a_process_count() -> None:
    assert CPUAccelerator.parse_devices(2) == 2
    assert CPUAccelerator.parse_devices("3") == 3
    assert CPUAccelerator.parse_devices("auto") == 1 and CPUAccelerator.parse_devices(-1) == 1
    assert parse_process_count(-1, auto=4) == 4
    assert CPUAccelerator.get_parallel_devices(2) == [torch.device("cpu")] * 2
    with pytest.raises(ValueError) as err:
        CPUAccelerator.parse_devices("0,1")
    assert str(err.value) == (
        "devices='0,1' lists device indices, but for the CPU devices= is the number of processes; use devices=2"
    )


@pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only messages")
@pytest.mark.parametrize(
    ("call", "what"),
    [
        (torchrig.current_device_index, "current_device_index()"),
        (lambda: torchrig.set_device_index(0), "set_device_index()"),
        (lambda: torchrig.device_index(0).__enter__(), "current_device_index()"),
    ],
)
def test_current_device_helpers_on_cpu_only(call: Any, what: str) -> None:
    with pytest.raises(RuntimeError) as err:
        call()
    assert str(err.value) == (
        f"{what} needs an accelerator, but torch.accelerator finds none here (CPU only); "
        "the CPU has no device index to get or set"
    )


# -- fuzz: any input parses or raises ValueError/TypeError with a message ---------------------
DEVICE_STRINGS = st.from_regex(re.compile(r"\s*-?[0-9]{0,2}(\s*,\s*-?[0-9]{0,2}){0,3}\s*,?\s*"), fullmatch=True)
SCALARS = st.one_of(
    st.integers(min_value=-5, max_value=10),
    st.integers(),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    DEVICE_STRINGS,
    st.just("auto"),
    st.binary(max_size=4),
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=2),
        st.frozensets(st.integers(0, 4), max_size=3),
    ),
    max_leaves=8,
)


def _parses_or_explains(fn: Any, devices: Any) -> Any:
    try:
        return fn(devices)
    except (ValueError, TypeError) as err:
        assert str(err).strip(), f"{type(err).__name__} with an empty message for devices={devices!r}"
        return None


@settings(max_examples=120, deadline=None)
@given(devices=JUNK)
def test_fuzz_normalize_devices(devices: Any) -> None:
    out = _parses_or_explains(normalize_devices, devices)
    if isinstance(out, list):
        assert out and len(set(out)) == len(out) and all(isinstance(i, int) and i >= 0 for i in out)
    elif out is not None:
        assert isinstance(out, int) and (out == -1 or out >= 1)


@settings(max_examples=120, deadline=None)
@given(devices=JUNK, available=st.integers(min_value=0, max_value=8))
def test_fuzz_select_indices(devices: Any, available: int) -> None:
    out = _parses_or_explains(lambda d: select_indices(d, device_type="cuda", available=available), devices)
    if out is not None:
        assert out and len(set(out)) == len(out) and all(0 <= i < available for i in out)


@settings(max_examples=120, deadline=None)
@given(devices=JUNK)
def test_fuzz_cpu_parse_devices(devices: Any) -> None:
    out = _parses_or_explains(CPUAccelerator.parse_devices, devices)
    if out is not None:
        assert isinstance(out, int) and out >= 1
