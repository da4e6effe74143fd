"""Gradient accumulation over a stream without a length: the epoch's last, partial window is
stepped (the loader reads one batch ahead to know the last batch), and the look-ahead does not
move the saved position: a resume continues with the batch after the last one trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_data_resume import IdRegressor, Samples, Stream, assert_same_fit, fit_in_pieces
from torch.utils.data import DataLoader, IterableDataset
from trainer_helpers import quiet_trainer, run_script

import torchrig

pytestmark = pytest.mark.timeout(60)


class NoDropout(IdRegressor):
    """IdRegressor without dropout: its run is the hand-written loop's, whatever the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def hand_written(steps_after: list[int], workers: int) -> dict[str, torch.Tensor]:
    """The plain loop over the same 10 batches (each worker reads its own part of the stream),
    stepping after the batches (counted from 1) in ``steps_after``; each micro-batch's loss
    divided by 4, as Lightning does for every window."""
    torch.manual_seed(0)
    module = NoDropout()
    optimizer = module.configure_optimizers()
    for i, (_, x, y) in enumerate(DataLoader(Stream(40), batch_size=4, num_workers=workers)):
        (torch.nn.functional.mse_loss(module.net(x), y) / 4).backward()
        if i + 1 in steps_after:
            optimizer.step()
            optimizer.zero_grad()
    return module.state_dict()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_last_partial_window_of_a_stream_is_stepped(tmp_path: Path, workers: int) -> None:
    torch.manual_seed(0)
    module = NoDropout()
    trainer = quiet_trainer(tmp_path, max_epochs=1, accumulate_grad_batches=4)
    trainer.fit(module, DataLoader(Stream(40), batch_size=4, num_workers=workers))
    assert len(module.trained) == 10 and trainer.global_step == 3  # steps after batches 4, 8 and 10
    expected, dropped = hand_written([4, 8, 10], workers), hand_written([4, 8], workers)
    assert all(torch.equal(module.state_dict()[k], expected[k]) for k in expected)  # bitwise
    assert not all(torch.equal(expected[k], dropped[k]) for k in expected)  # batches 9 and 10 count


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_accumulating_resumes_exactly_after_the_look_ahead(tmp_path: Path, workers: int) -> None:
    # 10 batches an epoch, 4 per step: steps after batches 4, 8, 10 of each epoch. The stops save
    # after batch 4 (batch 5 already read ahead), after the epoch's last batch (the stream already
    # ended) and after batch 4 of the second epoch.
    def make() -> DataLoader[Any]:
        return DataLoader(Stream(40), batch_size=4, num_workers=workers)

    kwargs: dict[str, Any] = {"max_epochs": 2, "accumulate_grad_batches": 4}
    whole = fit_in_pieces(tmp_path / "whole", make, [], **kwargs)
    pieces = fit_in_pieces(tmp_path / "pieces", make, [1, 3, 4], **kwargs)
    assert len(whole[0]) == 20
    assert whole[2]["state"][0]["step"] == 6  # three steps an epoch: the partial window stepped
    assert_same_fit(whole, pieces)


@pytest.mark.parametrize(("limit", "epochs", "steps"), [(5, [range(10)], 4), (12, [range(10), range(10)], 6)])
def test_a_limited_epoch_of_a_stream_reads_no_batch_past_its_limit(
    tmp_path: Path, limit: int, epochs: list[range], steps: int
) -> None:
    # Stream keeps its position when an epoch stops early, so each limited epoch goes on where the
    # last one stopped. With limit 5, reading ahead after the 5th batch read the 6th, which the
    # next epoch then never trained. With limit 12 the stream ends first (10 batches): the look-ahead
    # still finds that end and steps the partial window (after batches 4, 8, 10 of each epoch).
    torch.manual_seed(0)
    module = NoDropout()
    trainer = quiet_trainer(
        tmp_path, max_epochs=2, accumulate_grad_batches=4, limit_train_batches=limit, enable_model_summary=False
    )
    trainer.fit(module, DataLoader(Stream(40), batch_size=4))
    assert module.trained == [list(range(4 * b, 4 * b + 4)) for batches in epochs for b in batches]
    assert trainer.global_step == steps  # with limit 5: after batches 4 and 5 of each epoch


def test_the_look_ahead_stops_at_the_epoch_limit() -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    stream = Stream(12)
    loader = rig.setup_dataloader(DataLoader(stream, batch_size=2))
    loader.look_ahead, loader.epoch_limit = True, 3
    ends = []
    for i, _ in enumerate(loader):
        ends.append(loader.at_last_batch)
        if i == 2:
            break
    assert ends == [False, False, True] and stream.data.reads == 6  # the 4th batch is never read


class Noisy(Stream):
    """A stream that draws from torch's global RNG while it makes each sample (an augmentation)."""

    def __iter__(self) -> Any:
        for ids, x, y in super().__iter__():
            yield ids, x + 0.1 * torch.rand(4), y


def test_without_accumulation_a_stream_is_not_read_ahead_and_its_rng_draws_resume_exactly(tmp_path: Path) -> None:
    # In the main process (0 workers) the stream's draws and the training step's (dropout) share
    # torch's RNG: made when the loop asks for it, as in a hand-written loop, each batch draws
    # from the state the checkpoint before it holds. Read ahead, it would draw before the
    # previous batch's step, and a resume would draw it again from a later state.
    def make() -> DataLoader[Any]:
        return DataLoader(Noisy(40), batch_size=4)

    whole = fit_in_pieces(tmp_path / "whole", make, [], max_epochs=2)
    pieces = fit_in_pieces(tmp_path / "pieces", make, [3, 6, 14], max_epochs=2)
    assert len(whole[0]) == 20
    assert_same_fit(whole, pieces)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_saved_position_is_the_last_batch_given_out_not_the_one_read_ahead(workers: int) -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=1)

    def prepared() -> Any:
        loader = rig.setup_dataloader(DataLoader(Stream(12), batch_size=2, num_workers=workers))
        loader.look_ahead = True
        return loader

    plain = [ids.tolist() for ids, _, _ in DataLoader(Stream(12), batch_size=2, num_workers=workers)]
    loader = prepared()
    it = iter(loader)
    given = [next(it)[0].tolist() for _ in range(3)]
    assert given == plain[:3] and not loader.at_last_batch
    state = loader.state_dict()
    assert state["batches_seen"] == 3
    resumed = prepared()
    resumed.load_state_dict(state)
    rest = [ids.tolist() for ids, _, _ in resumed]  # the batch read ahead (the 4th) comes again
    assert rest == plain[3:] and len(rest) == 3 and resumed.at_last_batch
    assert [b[0].tolist() for b in it] == rest and loader.at_last_batch  # as the first loader goes on


def test_the_end_of_a_stream_is_known_only_when_looking_ahead() -> None:
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    loader = rig.setup_dataloader(DataLoader(Stream(4), batch_size=2))
    assert [loader.at_last_batch for _ in loader] == [False, False]  # no look-ahead: not known
    loader.look_ahead = True
    assert [loader.at_last_batch for _ in loader] == [False, True]
    sized = rig.setup_dataloader(DataLoader(Stream(4).data, batch_size=2))
    sized.look_ahead = True  # a length says where the epoch ends: nothing is read ahead
    assert [sized.at_last_batch for _ in sized] == [False, False]


class Shares(IterableDataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """``(id, x, y)`` of ``n`` samples, no ``__len__``; split across processes by the hook
    ``shard_for_rank``: rank ``r`` of ``W`` reads samples ``r, r + W, ...`` (equal shares when
    ``W`` divides ``n``)."""

    def __init__(self, n: int, rank: int = 0, world_size: int = 1) -> None:
        self.data, self.rank, self.world_size = Samples(n), rank, world_size

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(self.rank, len(self.data), self.world_size))

    def shard_for_rank(self, rank: int, world_size: int) -> Shares:
        return Shares(len(self.data), rank, world_size)


DDP_SCRIPT = r"""
import sys
from pathlib import Path
import torch
from torch.utils.data import DataLoader
import torchrig
from test_stream_accumulation import NoDropout, Shares

root = Path(sys.argv[1])
torch.manual_seed(0)
module = NoDropout()
trainer = torchrig.Trainer(
    accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, accumulate_grad_batches=4,
    enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
    default_root_dir=root,
)
trainer.fit(module, DataLoader(Shares(80), batch_size=4))
torch.save({"weights": module.state_dict(), "trained": module.trained, "steps": trainer.global_step},
           root / f"rank{trainer.global_rank}.pt")
"""


@pytest.mark.timeout(120)
@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_step_the_last_partial_window_of_equal_streams_together(tmp_path: Path) -> None:
    # Each rank's share: 40 samples, 10 batches of 4; steps after batches 4, 8 and 10. The last
    # window's gradients must be averaged across the ranks (no no_sync on its last batch), so
    # both ranks end equal, and equal to one process stepping the global batches of 8.
    run_script(tmp_path, DDP_SCRIPT, str(tmp_path), timeout=100)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["steps"] for r in ranks] == [3, 3]
    assert [sorted(i for b in r["trained"] for i in b) for r in ranks] == [list(range(0, 80, 2)), list(range(1, 80, 2))]
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])
    torch.manual_seed(0)
    module = NoDropout()
    optimizer = module.configure_optimizers()
    data = Samples(80)
    for i in range(10):  # global batch i: rank 0's and rank 1's batch i together
        x, y = data.x[8 * i : 8 * i + 8], data.y[8 * i : 8 * i + 8]
        (torch.nn.functional.mse_loss(module.net(x), y) / 4).backward()
        if i + 1 in (4, 8, 10):
            optimizer.step()
            optimizer.zero_grad()
    for key, value in module.state_dict().items():
        assert torch.allclose(ranks[0]["weights"][key], value, atol=1e-6), key


@pytest.mark.parametrize("look_ahead", [False, True])
def test_a_position_loaded_and_saved_again_before_the_next_epoch_is_the_one_loaded(look_ahead: bool) -> None:
    # A resumed fit may save before its first batch (a validation pending at the stop): the
    # position saved then is the one loaded, not where this process's loader last was (nor the
    # start of the stream, in a new process whose loader never ran).
    rig = torchrig.Rig(accelerator="cpu", devices=1)
    first = rig.setup_dataloader(DataLoader(Stream(12), batch_size=2))
    first.look_ahead = look_ahead
    it = iter(first)
    next(it)
    saved = first.state_dict()  # after 1 batch
    next(it), next(it)  # the loader reads on
    first.load_state_dict(saved)
    assert first.state_dict()["loader_state"] == saved["loader_state"]  # saved again as loaded
    fresh = rig.setup_dataloader(DataLoader(Stream(12), batch_size=2))
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["loader_state"] == saved["loader_state"]
    assert [ids.tolist() for ids, _, _ in first] == [[2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
