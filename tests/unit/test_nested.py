"""move_to_device / apply_to_tensors: every tensor moves, every container keeps its type."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from torchrig import move_to_device
from torchrig.nested import apply_to_tensors

pytestmark = pytest.mark.timeout(10)
META = torch.device("meta")  # a real second device on a CPU-only machine

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    label: str
    extra: list[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    n: int


class Movable:
    """A user object with its own ``.to()`` that records how it was called."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []

    def to(self, device: Any, **kwargs: Any) -> Movable:
        self.calls.append((device, kwargs))
        return self


class MovableNoKwargs:
    def __init__(self) -> None:
        self.device: Any = None

    def to(self, device: Any) -> MovableNoKwargs:
        self.device = device
        return self


class MyList(list):  # type: ignore[type-arg]
    pass


def test_nested_builtin_containers_move_and_keep_types() -> None:
    batch = {"a": [torch.ones(2), (torch.zeros(1), "s")], "n": 3, "arr": np.ones(2)}
    out = move_to_device(batch, META)
    assert type(out) is dict and type(out["a"]) is list and type(out["a"][1]) is tuple
    assert out["a"][0].device == META and out["a"][1][0].device == META
    assert out["n"] == 3 and out["a"][1][1] == "s"
    assert out["arr"] is batch["arr"]  # non-tensor leaves are untouched, not copied


def test_namedtuple_dataclass_and_frozen_dataclass_keep_their_type() -> None:
    out = move_to_device([Pair(torch.ones(1), 2), Batch(torch.ones(1), "l", [torch.ones(2)])], META)
    pair, batch = out
    assert isinstance(pair, Pair) and pair.x.device == META and pair.y == 2
    assert isinstance(batch, Batch) and batch.x.device == META and batch.extra[0].device == META
    assert batch.label == "l"
    frozen = move_to_device(FrozenBatch(torch.ones(1), 5), META)
    assert isinstance(frozen, FrozenBatch) and frozen.x.device == META and frozen.n == 5


def test_mappings_keep_type_and_defaultdict_keeps_its_factory() -> None:
    dd: defaultdict[str, list[torch.Tensor]] = defaultdict(list)
    dd["x"].append(torch.ones(1))
    out = move_to_device(dd, META)
    assert isinstance(out, defaultdict) and out.default_factory is list
    assert out["x"][0].device == META
    assert out["missing"] == []  # the factory still works
    od = move_to_device(OrderedDict(b=torch.ones(1), a=torch.ones(1)), META)
    assert isinstance(od, OrderedDict) and list(od) == ["b", "a"]


def test_list_subclass_keeps_its_type() -> None:
    out = move_to_device(MyList([torch.ones(1)]), META)
    assert isinstance(out, MyList) and out[0].device == META


def test_objects_with_to_are_moved_by_their_own_method() -> None:
    obj, plain = Movable(), MovableNoKwargs()
    out = move_to_device({"o": obj, "p": plain}, META)
    assert out["o"] is obj and obj.calls == [(META, {"non_blocking": True})]
    assert plain.device == META  # called without non_blocking, which it does not take
    move_to_device(obj, "cpu")  # never non_blocking towards the host
    assert obj.calls[-1] == (torch.device("cpu"), {"non_blocking": False})


def test_tensor_already_on_device_is_returned_as_is() -> None:
    t = torch.ones(3)
    assert move_to_device(t, "cpu") is t
    assert move_to_device((t,), torch.device("cpu"))[0] is t


def test_modules_move_through_their_to() -> None:
    layer = torch.nn.Linear(2, 2)
    out = move_to_device({"m": layer}, META)
    assert out["m"].weight.device == META


def test_apply_to_tensors_preserves_types() -> None:
    data = {"p": Pair(torch.ones(1), torch.ones(1)), "b": Batch(torch.ones(1), "l", []), "s": "x"}
    out = apply_to_tensors(data, lambda t: t * 2)
    assert isinstance(out["p"], Pair) and out["p"].x.item() == 2.0
    assert isinstance(out["b"], Batch) and out["b"].x.item() == 2.0 and out["s"] == "x"


def _encoded() -> Any:
    """A transformers ``BatchEncoding`` from a real (tiny, local) fast tokenizer: it carries
    ``encodings`` beside its tensors, which ``word_ids()`` reads."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3, "again": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="[PAD]", unk_token="[UNK]")
    return tokenizer(["hello world", "hello again world"], padding=True, return_tensors="pt")


def test_a_batch_encoding_keeps_its_type_and_encodings_on_the_move() -> None:
    batch = _encoded()
    assert batch.word_ids(1) == [0, 1, 2]
    moved = move_to_device(batch, META)
    assert type(moved) is type(batch) and moved["input_ids"].device == META
    assert moved.word_ids(0) == [0, 1, None] and moved.word_ids(1) == [0, 1, 2]  # raised before: encodings lost
    nested = move_to_device({"enc": batch, "n": 1}, META)  # inside a container, through the same path
    assert nested["enc"].word_ids(1) == [0, 1, 2] and nested["enc"]["attention_mask"].device == META


def test_apply_to_tensors_keeps_a_mappings_attributes() -> None:
    batch = _encoded()
    doubled = apply_to_tensors(batch, lambda t: t * 2)  # as the precision's input cast and all_gather go
    assert type(doubled) is type(batch) and doubled.word_ids(1) == [0, 1, 2]
    assert torch.equal(doubled["input_ids"], batch["input_ids"] * 2)
    assert batch["input_ids"].max() == 4  # the original is untouched

    class Tagged(dict):  # type: ignore[type-arg]
        tag = "class"

    tagged = Tagged(x=torch.ones(1))
    tagged.tag = "mine"
    out = apply_to_tensors(tagged, lambda t: t + 1)
    assert isinstance(out, Tagged) and out.tag == "mine" and out["x"].item() == 2.0 and tagged["x"].item() == 1.0
