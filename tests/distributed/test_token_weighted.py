"""Token-weighted gradient accumulation: ``training_step`` returns ``{"loss": loss_sum,
"num_items": n}`` and the Trainer's gradient is that of one big batch, sum(loss) / sum(items),
over the accumulation window and every process (issue 18). Padded sequences of unequal lengths
(``scripts/token_weighted.py``), compared after plain SGD steps with a direct computation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import SCRIPTS, explain, load_script, result, run

import torchrig
from torchrig.trainer.metrics import to_floats

tw = load_script("token_weighted")
ALL = list(range(len(tw.LENGTHS)))


def assert_close(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert sorted(weights) == sorted(ref)
    for key, value in ref.items():
        assert torch.allclose(weights[key], value, atol=tol, rtol=tol), (key, (weights[key] - value).abs().max())


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_the_data_tells_the_token_mean_from_the_mean_of_micro_batch_means() -> None:
    # Without this the tests below could pass with the old per-micro-batch mean.
    ref, _ = tw.reference([ALL])
    old, _ = tw.fit(mode="mean", accumulate=4, max_steps=1)
    assert max_difference(old, ref) > 1e-3
    counts = [sum(tw.LENGTHS[i : i + 2]) for i in range(0, len(tw.LENGTHS), 2)]
    assert len(set(counts)) > 1, counts  # the micro-batches do hold different numbers of tokens


@pytest.mark.parametrize("mode", ["tensor", "int", "numpy"])
def test_one_process_accumulating_four_micro_batches_steps_like_one_batch(mode: str) -> None:
    # Two epochs of one optimizer step each (4 micro-batches of 2 padded sequences).
    weights, trainer = tw.fit(mode=mode, accumulate=4, max_steps=2)
    assert trainer.global_step == 2
    ref, _ = tw.reference([ALL, ALL])
    assert_close(weights, ref)


def test_each_window_is_counted_on_its_own() -> None:
    # accumulate_grad_batches=2: two optimizer steps per epoch, each over its own 4 sequences.
    weights, _ = tw.fit(accumulate=2, max_steps=2)
    ref, _ = tw.reference([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert_close(weights, ref)


def test_without_accumulation_each_batch_is_its_own_token_mean() -> None:
    weights, _ = tw.fit(accumulate=1, max_steps=3)
    ref, _ = tw.reference([[0, 1], [2, 3], [4, 5]])
    assert_close(weights, ref)


def test_the_gradients_are_scaled_before_clipping() -> None:
    _, norms = tw.reference([ALL])
    clip = norms[0] / 4  # active: the step's gradient norm is 4x the threshold
    ref, _ = tw.reference([ALL], clip=clip)
    unclipped, _ = tw.reference([ALL])
    assert max_difference(ref, unclipped) > 1e-3
    weights, _ = tw.fit(accumulate=4, max_steps=1, clip=clip)
    assert_close(weights, ref)


def test_16_mixed_unscales_and_clips_the_scaled_gradients() -> None:
    # The GradScaler's scale multiplies loss_sum; the token scaling, the unscale and the clip must
    # compose to the fp32 reference's clipped steps (up to fp16 autocast's rounding). A sum over
    # many tokens overflows fp16 at the first scales (65536, ...): those steps are skipped and the
    # scale halves each time, so the steps taken are the ones after them.
    _, norms = tw.reference([ALL])
    clip = norms[0] / 4
    steps = 6
    weights, trainer = tw.fit(accumulate=4, max_steps=steps, clip=clip, precision="16-mixed")
    scaler = trainer.rig.precision.scaler
    assert scaler is not None
    skipped = round(math.log2(2.0**16 / scaler.get_scale()))
    assert 0 <= skipped <= steps - 2, skipped  # at least two steps were taken
    ref, _ = tw.reference([ALL] * (steps - skipped), clip=clip)
    assert max_difference(weights, tw.init_state()) > 1e-3
    assert_close(weights, ref, tol=1e-3)


def test_the_progress_bar_shows_the_mean_per_item() -> None:
    bar = torchrig.ProgressBar()
    bar._loss = {"loss": torch.tensor(12.0), "num_items": torch.tensor(8)}
    assert to_floats(bar._train_values(object()))["loss"] == 1.5  # type: ignore[arg-type]
    bar._loss = {"loss": torch.tensor(12.0), "num_items": 3}
    assert to_floats(bar._train_values(object()))["loss"] == 4.0  # type: ignore[arg-type]


class Returns(torchrig.TrainingModule):
    """Returns ``make(batch_idx, loss_sum)`` from each training_step."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.make(batch_idx, self.layer(batch[0]).pow(2).sum())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit_returning(make: Any, accumulate: int = 1, steps: int = 1) -> Returns:
    torch.manual_seed(0)  # the same weights and data in every call
    module = Returns(make)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = torchrig.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    return module


@pytest.mark.parametrize(
    ("num_items", "error", "message"),
    [
        ("7", TypeError, "training_step returned num_items='7' (str); it must be an int, a float or a 0-d tensor"),
        (None, TypeError, "training_step returned num_items=None (NoneType); it must be an int"),
        (True, TypeError, "training_step returned num_items=True (bool); it must be an int"),
        (
            torch.tensor([3, 4]),
            TypeError,
            "training_step returned num_items=a tensor of shape (2,) and dtype torch.int64; it must be an int",
        ),
        (-1, ValueError, "training_step returned num_items=-1; it must be a finite number >= 0"),
        (float("nan"), ValueError, "training_step returned num_items=nan; it must be a finite number >= 0"),
    ],
)
def test_a_bad_num_items_is_refused(num_items: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        fit_returning(lambda i, loss: {"loss": loss, "num_items": num_items})
    assert message in str(caught.value)


@pytest.mark.parametrize("loss", [None, 2.5])
def test_num_items_without_a_loss_tensor_is_refused(loss: Any) -> None:
    with pytest.raises(TypeError) as caught:
        fit_returning(lambda i, _: {"num_items": 4} if loss is None else {"loss": loss, "num_items": 4})
    shown = "None (NoneType)" if loss is None else "2.5 (float)"
    assert str(caught.value) == (
        f"training_step returned a dict with 'num_items' and loss={shown}; return "
        "{'loss': loss_sum, 'num_items': n}: the loss tensor summed (not averaged) over the n items"
    )


@pytest.mark.parametrize("first", ["items", "plain"])
def test_a_window_mixing_num_items_and_plain_losses_is_refused(first: str) -> None:
    def make(i: int, loss: torch.Tensor) -> Any:
        return {"loss": loss, "num_items": 2} if (i == 0) == (first == "items") else loss

    with pytest.raises(TypeError) as caught:
        fit_returning(make, accumulate=2)
    assert str(caught.value) == (
        "training_step returned a dict with 'num_items' for some batches of the accumulation window 0..1 and a "
        "plain loss for others; return num_items from every training_step or from none (on every process)"
    )


def test_a_skipped_batch_in_a_window_counts_nothing() -> None:
    # None skips a micro-batch (here the window's last one): the window is its other batch alone.
    skipped = fit_returning(lambda i, loss: None if i == 1 else {"loss": loss, "num_items": 2}, accumulate=2)
    alone = fit_returning(lambda i, loss: {"loss": loss, "num_items": 2}, accumulate=1)
    for a, b in zip(skipped.parameters(), alone.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7)


def test_a_step_without_items_leaves_zero_gradients() -> None:
    torch.manual_seed(0)
    start = Returns(None)  # the weights fit_returning starts from
    module = fit_returning(lambda i, loss: {"loss": loss * 0, "num_items": torch.tensor(0)}, accumulate=2)
    for a, b in zip(module.parameters(), start.parameters(), strict=True):
        assert torch.equal(a, b)  # plain SGD with zero gradients: the weights did not move
        # the last window's gradients stay until the next step zeroes them (Lightning's order): zeros, no NaN
        assert a.grad is None or torch.equal(a.grad, torch.zeros_like(a.grad))


@pytest.mark.parametrize("clip", [False, True])
def test_the_rig_recipe_in_one_process_steps_like_one_batch(clip: bool) -> None:
    threshold = tw.reference([ALL])[1][0] / 4 if clip else None
    weights = tw.rig_fit(torchrig.Rig(accelerator="cpu"), accumulate=4, max_steps=2, clip=threshold)
    ref, _ = tw.reference([ALL, ALL], clip=threshold)
    assert_close(weights, ref)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_plain_loss_never_counts_nor_scales(monkeypatch: pytest.MonkeyPatch, accumulate: int) -> None:
    from torchrig.trainer import step_runner

    def refuse(*args: Any) -> None:
        raise AssertionError("a plain loss reached the token-weighted path")

    monkeypatch.setattr(step_runner.ItemWindow, "add", refuse)
    monkeypatch.setattr(step_runner.ItemWindow, "finish", refuse)
    monkeypatch.setattr(torch.distributed, "all_reduce", refuse)
    fit_returning(lambda i, loss: loss, accumulate=accumulate, steps=2)
    fit_returning(lambda i, loss: {"loss": loss}, accumulate=accumulate, steps=2)
    with pytest.raises(AssertionError, match="token-weighted path"):  # the patch does catch the path
        fit_returning(lambda i, loss: {"loss": loss, "num_items": 2}, accumulate=accumulate)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "clip", "loop"),
    [
        ("ddp", False, "trainer"),
        ("ddp", True, "trainer"),
        ("fsdp", True, "trainer"),
        ("tp", True, "trainer"),
        ("tp_partial", True, "trainer"),
        ("ddp", False, "rig"),
    ],
)
def test_two_processes_accumulating_two_micro_batches_each_step_like_one_batch(
    tmp_path: Path, strategy: str, clip: bool, loop: str
) -> None:
    # 2 gloo processes x 2 micro-batches = the 4 micro-batches (8 sequences) of one step, twice.
    # DDP and FSDP2 both average the gradients over the processes (FSDP's are DTensor shards).
    # "tp": 2 tensor-parallel processes that both see all 4 micro-batches (one data-parallel
    # rank); each returns the count, so the count summed over the processes is twice the tokens.
    # "tp_partial": the plan splits only the first layer, so the head's gradients stay plain tensors
    # beside DTensors (as every norm outside a plan does).
    ref, norms = tw.reference([ALL, ALL])
    threshold = norms[0] / 4 if clip else None
    if clip:
        ref, _ = tw.reference([ALL, ALL], clip=threshold)
    out = tmp_path / "w.pt"
    args = [str(SCRIPTS / "token_weighted.py"), "--out", str(out), "--devices", "2", "--strategy", strategy]
    args += ["--accumulate", "4" if strategy.startswith("tp") else "2", "--max-steps", "2", "--loop", loop] + (
        ["--clip", repr(threshold)] if clip else []
    )
    proc = run(args, timeout=110)
    assert proc.returncode == 0, explain(proc)
    weights, info = result(out)
    assert info == {
        "world_size": 2,
        "strategy": {"ddp": "DDPStrategy", "fsdp": "FSDPStrategy"}.get(strategy, "ModelParallelStrategy"),
    }
    assert_close(weights, ref)
