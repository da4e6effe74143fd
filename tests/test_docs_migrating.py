"""docs/migrating.md as written: every python block runs and prints exactly the text block under
it, and the torchrig names its tables give exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT
from test_readme import run_block
from trainer.test_trainer_tools_docs import blocks

DOC = (ROOT / "docs" / "migrating.md").read_text()
SNIPPETS = blocks(DOC, "python")


def shown_output(code: str) -> str:
    """The ```text block after the python block ``code``: what the guide says it prints."""
    after = DOC[DOC.index(code) + len(code) :]
    found = re.match(r"```\n\n(?:(?!```)[^\n]+\n\n)?```text\n(.*?)```", after, re.S)  # a line of prose may come between
    assert found, f"no ```text block of its output right after the snippet starting {code[:60]!r}"
    return found.group(1)


def heading_of(code: str) -> str:
    prose = re.sub(r"```.*?```", "", DOC[: DOC.index(code)], flags=re.S)  # comments in code are no headings
    return re.findall(r"^#+ (.*)$", prose, re.M)[-1]


def test_the_guide_has_a_snippet_per_section() -> None:
    assert [heading_of(code) for code in SNIPPETS] == [
        "From Lightning 1.x: the `Accelerator` API",
        "Trainer and LightningModule",
        "Fabric",
        "From Accelerate",
        "Checkpoints from Lightning and Accelerate",
    ]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("index", range(len(SNIPPETS)), ids=[heading_of(c) for c in SNIPPETS])
def test_each_snippet_prints_what_the_guide_shows(index: int, tmp_path: Path) -> None:
    code = SNIPPETS[index]
    out = run_block(code, tmp_path)
    # A resumed fit names the checkpoint by its absolute path; the guide shows the run's directory as ".".
    assert out.replace(str(tmp_path.resolve()), ".") == shown_output(code), out


def test_the_1x_table_names_every_method_of_the_accelerator_api() -> None:
    table = DOC[DOC.index("| Lightning 1.x `Accelerator` |") : DOC.index("The whole API in one loop")]
    documented = [
        "batch_to_device", "backward", "optimizer_step", "clip_gradients", "all_gather", "broadcast",
        "barrier", "model_sharded_context", "process_dataloader", "save_checkpoint",
        "lightning_module_state_dict", "optimizer_state", "setup", "teardown", "training_step",
        "validation_step", "test_step", "predict_step", "training_step_end", "validation_step_end",
        "test_step_end", "on_train_start", "on_train_epoch_end", "on_train_end", "dispatch", "pre_dispatch",
        "post_dispatch", "setup_environment", "setup_optimizers", "connect", "to_device",
        "optimizer_zero_grad", "lightning_module", "results", "setup_optimizers_in_pre_dispatch",
        "call_configure_sharded_model_hook",
    ]  # fmt: skip
    for name in documented:
        assert re.search(rf"^\| `{name}[(` ]|, `{name}[(`]", table, re.M), name


def test_an_accelerator_carrying_another_precision_or_strategy_than_given_is_refused() -> None:
    """The guide: giving both, with different values, is a ValueError that names the two."""
    import torchrig

    assert "is a `ValueError` that names the two" in DOC
    acc = torchrig.CPUAccelerator(precision_plugin="bf16-mixed", training_type_plugin="single")
    with pytest.raises(
        ValueError, match=r"precision='32-true' was given, but the accelerator 'cpu' carries precision='bf16-mixed'"
    ):
        torchrig.Rig(accelerator=acc, precision="32-true")
    with pytest.raises(
        ValueError, match=r"strategy='ddp' was given, but the accelerator 'cpu' carries strategy='single'"
    ):
        torchrig.Trainer(accelerator=acc, strategy="ddp", logger=False)


def table_rows() -> list[str]:
    return [line for line in DOC.splitlines() if line.startswith("| ")]


def test_every_rig_trainer_and_torchrig_name_in_the_tables_exists() -> None:
    import torchrig
    import torchrig.checkpoint
    import torchrig.checkpoint.peers
    import torchrig.cli
    import torchrig.tune
    from torchrig.trainer.callbacks import Callback
    from torchrig.wrappers import RigModule

    rig = torchrig.Rig(accelerator="cpu")
    trainer = torchrig.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    # The torchrig columns (all but the first) of every row: where the names must exist.
    columns = " ".join(" ".join(row.split(" | ")[1:]) for row in table_rows() if row.count(" | ") >= 2)
    ours = " ".join(re.findall(r"`([^`]+)`", columns))  # the code spans: names, not links
    checked = 0
    for owner, pattern in (
        (rig, r"\brig\.(\w+)"),
        (trainer, r"\btrainer\.(\w+)"),
        (trainer.rig.strategy, r"\bstrategy\.(\w+)"),
        (torchrig, r"\btorchrig\.([\w.]+)"),
        (torchrig.Strategy, r"\bStrategy\.(\w+)"),
        (torchrig.Accelerator, r"\bAccelerator\.(\w+)"),
        (torchrig.TrainingModule, r"\bTrainingModule\.(\w+)"),
        (Callback, r"\bCallback\.(\w+)"),
        (RigModule, r"\bmodel\.(module)\b"),
    ):
        names = {found.rstrip(".") for found in re.findall(pattern, ours)}
        assert names, f"the tables name nothing matching {pattern}"
        for name in names:
            target: object = owner
            for part in name.split("."):
                assert hasattr(target, part), f"{type(owner).__name__}: {name}"
                target = getattr(target, part)
            checked += 1
    assert checked > 40, checked
    # Every class a code span of the torchrig column starts with is torchrig's (RigModule: what prepare returns).
    ours_column = [row.split(" | ")[1] for row in table_rows() if row.count(" | ") >= 2]
    classes = {n for column in ours_column for n in re.findall(r"`(?:torchrig\.)?([A-Z]\w*?[a-z]\w*)", column)}
    assert {"CPUAccelerator", "DDPStrategy", "ThroughputMonitor", "RigModule"} <= classes, classes
    for name in classes:
        assert name == RigModule.__name__ or hasattr(torchrig, name), f"torchrig.{name}"
    # The Trainer arguments the table says keep their names, and the ones it says have none.
    import inspect

    args = inspect.signature(torchrig.Trainer).parameters
    same = next(row for row in table_rows() if row.startswith("| `lightning.pytorch.Trainer(...)`"))
    for name in re.findall(r"`(\w+)`", same.split(" | ")[2]):
        assert name in args or name in ("_val_", "_test_", "_predict_"), name
    more = next(row for row in table_rows() if row.startswith("| `Trainer(min_epochs="))
    for name in re.findall(r"(\w+)=", more.split(" | ")[0]):
        assert name in args, f"the guide says Trainer has {name}=, but it has not"
    refused = next(row for row in table_rows() if row.startswith("| `plugins`, `barebones`"))
    for name in re.findall(r"`(\w+)`", refused.split(" | ")[0]):
        assert name not in args, f"the guide says Trainer refuses {name}=, but it takes it"
    events = next(row for row in table_rows() if row.startswith("| `Callback` |"))
    for name in re.findall(r"`(\w+)`", events.split(" | ")[2]):
        assert callable(getattr(Callback, name, None)), name


def test_every_lightning_trainer_argument_and_callback_has_a_row() -> None:
    lightning = pytest.importorskip("lightning.pytorch")
    import inspect

    import lightning.pytorch.callbacks as lightning_callbacks

    table = DOC[DOC.index("### Every Trainer argument and callback") : DOC.index("### Fabric")]
    arguments = [p for p in inspect.signature(lightning.Trainer.__init__).parameters if p != "self"]
    callbacks = [
        name
        for name in dir(lightning_callbacks)
        if isinstance(getattr(lightning_callbacks, name), type)
        and issubclass(getattr(lightning_callbacks, name), lightning_callbacks.Callback)
    ]
    missing = [n for n in arguments + callbacks if f"`{n}`" not in table and f"`{n}(" not in table]
    assert not missing, f"docs/migrating.md lacks rows for {missing}"


def test_the_hook_table_names_every_lightning_hook_and_torchrig_has_each() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torchrig import Callback, TrainingModule

    table = DOC[DOC.index("| Lightning 2.6 (in the order of a fit) |") : DOC.index("### Fabric")]
    named = set(re.findall(r"`(?:Callback\.)?(\w+)", table))
    lightning = {n for n in dir(pl.LightningModule) if n.startswith("on_") and n != "on_gpu"}
    lightning |= {"prepare_data", "setup", "configure_model", "teardown", "transfer_batch_to_device"}
    lightning |= {n for n in dir(pl.Callback) if n.startswith("on_")}
    assert lightning - named == set()  # the table is complete
    for name in lightning:
        assert callable(getattr(TrainingModule, name, None)) or callable(getattr(Callback, name, None)), name
