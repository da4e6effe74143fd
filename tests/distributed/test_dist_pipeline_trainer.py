"""The Trainer with pipeline parallel (``ModelParallelStrategy(pipeline_parallel=2)``) on 2 real gloo processes.

``scripts/pipeline_fit.py`` fits a TrainingModule around the demo transformer (4 blocks) for 4
steps (validating every 2, clipping, a CSV logger, a ThroughputMonitor, a checkpoint every 2
steps), then validates, tests and predicts; every result is compared with the same run in one
process. ``pp=2 x dp_shard=2`` runs on 4 processes, the others on 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import SCRIPTS, explain, load_script, run

pytestmark = pytest.mark.distributed

SCRIPT = str(SCRIPTS / "pipeline_fit.py")


def launch(root: Path, *args: str) -> dict[str, Any]:
    out = root / "result.pt"
    proc = run([SCRIPT, str(root), str(out), "--devices", "2", "--pp", "2", *args], timeout=140)
    assert proc.returncode == 0, explain(proc)
    result: dict[str, Any] = torch.load(out)
    result["rank1"] = torch.load(f"{out}.rank1")
    return result


def reference(root: Path, **kwargs: Any) -> dict[str, Any]:
    """The same run in this one process."""
    return load_script("pipeline_fit").run(str(root), **kwargs)[0]  # type: ignore[no-any-return]


def logged(result: dict[str, Any], name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of each row of the CSV log (rank 0's) that holds ``name``."""
    return [(row["step"], row[name]) for row in result["rows"] if name in row]


def assert_close(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [s for s, _ in got] == [s for s, _ in want]
    assert torch.allclose(torch.tensor([v for _, v in got]), torch.tensor([v for _, v in want]), atol=1e-5)


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 2e-4) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert torch.allclose(got[key], value, atol=atol, rtol=1e-4), (key, (got[key] - value).abs().max())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return reference(tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def two_stages(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("pp")
    return root, launch(root)


@pytest.mark.timeout(120)
def test_fit_on_two_stages_trains_logs_and_validates_like_one_process(
    one_process: dict[str, Any], two_stages: tuple[Path, dict[str, Any]]
) -> None:
    _, got = two_stages
    # the loss of each step as rank 0's logger wrote it: the last stage's, broadcast (rank 0
    # holds the first stage and computes no loss)
    assert len(logged(got, "train_loss")) == 4
    assert_close(logged(got, "train_loss"), logged(one_process, "train_loss"))
    # validation inside the fit (after steps 2 and 4) through the forward-only schedule
    assert_close(logged(got, "val_loss"), logged(one_process, "val_loss"))
    assert_same_weights(got["weights"], one_process["weights"])  # clipped by the norm over both stages
    # every rank holds the same metrics: the values logged come from the whole model on each
    assert got["fitted"] == pytest.approx(got["rank1"], abs=0) and set(got["fitted"]) == {"train_loss", "val_loss"}
    assert got["fitted"] == pytest.approx(one_process["fitted"], abs=1e-5)


@pytest.mark.timeout(120)
def test_validate_test_and_predict_run_through_the_schedule(
    one_process: dict[str, Any], two_stages: tuple[Path, dict[str, Any]]
) -> None:
    _, got = two_stages
    # batches of 8 and 2 samples: the second runs as 2 microbatches (4 do not divide it)
    assert got["validate"][0]["val_loss"] == pytest.approx(one_process["validate"][0]["val_loss"], abs=1e-5)
    assert got["test"][0]["test_acc"] == pytest.approx(one_process["test"][0]["test_acc"], abs=1e-6)
    # the predictions once each, in dataset order: both stages hold the output, one is gathered
    assert [p.shape for p in got["predict"]] == [(8, 8), (2, 8)]
    assert all(torch.equal(a, b) for a, b in zip(got["predict"], one_process["predict"], strict=True))


@pytest.mark.timeout(120)
def test_throughput_counts_the_batch_once_for_both_stages(two_stages: tuple[Path, dict[str, Any]]) -> None:
    _, got = two_stages
    values = got["throughput"]
    # one data-parallel rank: the two stages train one batch, so the global samples/s is this rank's
    assert values["throughput/samples_per_sec"] == values["throughput/samples_per_sec_per_device"] > 0


@pytest.mark.timeout(120)
def test_fit_resumes_exactly_from_a_pipelined_checkpoint(
    two_stages: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, whole = two_stages
    assert whole["checkpoints"] == ["epoch=0-step=2", "epoch=0-step=4"]
    resumed = launch(tmp_path, "--resume", str(root / "ckpt" / "epoch=0-step=2"))
    assert [s for s, _ in logged(resumed, "train_loss")] == [3, 4]  # steps 3 and 4 only
    assert logged(resumed, "train_loss") == logged(whole, "train_loss")[2:]  # bitwise: same layout
    assert_same_weights(resumed["weights"], whole["weights"], atol=0)


@pytest.mark.timeout(120)
def test_accumulated_steps_on_two_stages_match_one_process(tmp_path: Path) -> None:
    # two batches per optimizer step: each microbatch's loss divided by 4 microbatches x 2 batches
    got = launch(tmp_path / "pp", "--schedule", "Interleaved1F1B", "--accumulate", "2", "--steps", "2")
    want = reference(tmp_path / "one", accumulate=2, steps=2)
    assert_close(logged(got, "train_loss"), logged(want, "train_loss"))
    assert_same_weights(got["weights"], want["weights"])


@pytest.mark.timeout(150)
def test_pipeline_times_fsdp_on_four_processes_fits_evaluates_and_predicts_like_one(
    one_process: dict[str, Any], tmp_path: Path
) -> None:
    # pp=2 x dp_shard=2: each stage sharded by FSDP2 over 2 ranks, each reading half of every batch
    got = launch(tmp_path, "--devices", "4")
    assert_close(logged(got, "train_loss"), logged(one_process, "train_loss"))  # sync_dist: the global mean
    assert_close(logged(got, "val_loss"), logged(one_process, "val_loss"))
    assert_same_weights(got["weights"], one_process["weights"])
    assert got["test"][0]["test_acc"] == pytest.approx(one_process["test"][0]["test_acc"], abs=1e-6)
    # half of each batch on each data-parallel rank, gathered back into dataset order once
    assert all(torch.equal(a, b) for a, b in zip(got["predict"], one_process["predict"], strict=True))
    values = got["throughput"]  # two data-parallel ranks: twice one rank's samples/s
    assert values["throughput/samples_per_sec"] == pytest.approx(2 * values["throughput/samples_per_sec_per_device"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flag", "error"),
    [
        (
            "--manual",
            "ValueError: LM sets automatic_optimization = False, but under pipeline_parallel the schedule runs each "
            "step's backward itself (loss = self.forward_loss(loss_fn, x, target=y) in training_step)",
        ),
        (
            "--items",
            "ValueError: training_step returned {'loss': ..., 'num_items': ...}, but under pipeline_parallel the "
            "schedule averages the microbatches' losses before the Trainer could weight them by their items",
        ),
    ],
)
def test_steps_the_schedule_cannot_run_are_refused(tmp_path: Path, flag: str, error: str) -> None:
    # manual optimization (its own backward passes) and token-weighted steps (a count to weight by)
    out = tmp_path / "result.pt"
    proc = run([SCRIPT, str(tmp_path), str(out), "--devices", "2", "--pp", "2", flag], timeout=110)
    assert proc.returncode != 0 and not out.exists()
    assert error in proc.stderr, explain(proc)
