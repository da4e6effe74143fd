"""Every argument the Trainer, the Rig and ``seed_everything`` refuse is a ValueError/TypeError naming it."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainer_helpers import Regressor, loader, quiet_trainer

import torchrig
from torchrig import Trainer
from torchrig.rig import seed_everything


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"gradient_clip_val": math.nan}, ValueError, "gradient_clip_val=nan must be a finite number >= 0; pass None"),
        ({"gradient_clip_val": math.inf}, ValueError, "gradient_clip_val=inf must be a finite number >= 0; pass None"),
        ({"gradient_clip_val": -1.0}, ValueError, "gradient_clip_val=-1.0 must be a finite number >= 0"),
        ({"gradient_clip_val": 10**400}, ValueError, "gradient_clip_val=<int of 401 digits> must be a finite number"),
        ({"gradient_clip_val": "1"}, TypeError, "gradient_clip_val='1' must be a number, not str"),
        ({"devices": 10**400}, ValueError, "devices=<int of 401 digits> asks for more than 65536 devices"),
        ({"devices": 2**63}, ValueError, "devices=9223372036854775808 asks for more than 65536 devices"),
        ({"devices": [2**63]}, ValueError, "devices=[9223372036854775808] holds an index above 65536"),
        ({"max_time": 10**400}, ValueError, "max_time=<int of 401 digits> must be a finite number > 0"),
        ({"max_time": math.nan}, ValueError, "max_time=nan must be a finite number > 0"),
        ({"max_time": "00:00:00:" + "9" * 400}, ValueError, "max_time='00:00:00:9999"),
        ({"max_time": "00:00:00:\u00b2"}, ValueError, "max_time='00:00:00:\u00b2': give seconds (> 0)"),
        ({"accumulate_grad_batches": 10**400}, ValueError, "accumulate_grad_batches=<int of 401 digits> must be"),
        ({"max_epochs": 1.5}, TypeError, "max_epochs=1.5 must be an int, not float"),
        ({"seed": 10**40}, ValueError, "seed=<int of 41 digits> must be an int in [-9223372036854775808, "),
        ({"default_root_dir": 1}, TypeError, "default_root_dir=1 must be a path (str or os.PathLike), not int"),
        ({"callbacks": 1}, TypeError, "callbacks must be torchrig Callback objects; got int"),
        ({"logger": 1}, TypeError, "logger must be a torchrig Logger, a list of them, True or False; got int"),
    ],
)
def test_refused_arguments_are_named(tmp_path: Path, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        quiet_trainer(tmp_path, **kwargs)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.5, 10**400])
def test_clip_gradients_refuses_nan_inf_and_negative(bad: float) -> None:
    rig = torchrig.Rig(accelerator="cpu")
    model = torch.nn.Linear(2, 1)
    model, optimizer = rig.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rig.backward(model(torch.ones(1, 2)).sum())
    before = [p.grad.clone() for p in model.parameters()]
    for kw in ("max_norm", "clip_val"):
        with pytest.raises(ValueError, match=rf"{kw}=.+ must be a finite number >= 0; pass None for no clipping"):
            rig.clip_gradients(model, optimizer, **{kw: bad})
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters(), strict=True))


def test_seed_everything_refuses_seeds_torch_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # restored after the test
    with pytest.raises(ValueError, match=r"seed=<int of 41 digits> must be an int in \["):
        seed_everything(10**40)
    for seed in (2**64 - 1, -5):
        assert seed_everything(seed) == seed
        # a child process started now must accept the hash seed (Python takes 0 to 2**32 - 1)
        assert 0 <= int(os.environ["PYTHONHASHSEED"]) < 2**32


@pytest.mark.timeout(30)
def test_gradient_clip_zero_means_no_clipping_and_a_fit_stays_finite(tmp_path: Path) -> None:
    assert quiet_trainer(tmp_path, gradient_clip_val=0).gradient_clip_val is None
    trainer = quiet_trainer(tmp_path, gradient_clip_val=0.5, max_epochs=1)
    module = Regressor()
    trainer.fit(module, loader(8))
    assert all(torch.isfinite(p).all() for p in module.parameters())


# -- fuzz: any value of any argument is accepted or refused with its name ---------------------
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=3),
    st.sampled_from([object(), b"x", 1j, Path("x"), [object()], {"a": 1}]),
)
_ARGS = [
    "accelerator", "strategy", "precision", "devices", "num_nodes", "timeout", "max_epochs", "max_steps",
    "max_time", "accumulate_grad_batches",
    "gradient_clip_val", "gradient_clip_algorithm", "val_check_interval", "check_val_every_n_epoch",
    "limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
    "num_sanity_val_steps", "callbacks", "logger", "log_every_n_steps", "default_root_dir",
    "deterministic", "seed", "fast_dev_run", "overfit_batches", "detect_anomaly", "profiler",
    "enable_model_summary",
]  # fmt: skip


@pytest.mark.timeout(120)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_ARGS), value=_VALUES)
def test_fuzz_trainer_arguments(tmp_path: Path, name: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"accelerator": "cpu", "enable_progress_bar": False, "enable_checkpointing": False}
    if name != "logger":
        kwargs["logger"] = False
    if name != "default_root_dir":
        kwargs["default_root_dir"] = tmp_path
    counted = isinstance(value, (int, str)) and not isinstance(value, bool) and str(value).strip().isdigit()
    if name == "devices" and counted and 1 < int(str(value).strip()) <= 65536:
        return  # a valid process count: it would start that many processes
    kwargs[name] = value
    try:
        Trainer(**kwargs)
    except (ValueError, TypeError) as err:
        assert name in str(err), f"{type(err).__name__} for {name}={value!r} does not name it: {err}"


def test_seed_makes_a_module_built_after_the_trainer_the_same_in_every_run(tmp_path: Any) -> None:
    from trainer_helpers import params

    weights = []
    for unrelated in (1, 2):  # whatever the random state before the Trainer
        torch.manual_seed(unrelated)
        trainer = quiet_trainer(tmp_path, max_epochs=1, seed=0)
        module = Regressor()
        start = params(module)
        trainer.fit(module, loader(8, shuffle=True))
        weights.append((start, params(module)))
    for before, after in zip(weights[0], weights[1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
