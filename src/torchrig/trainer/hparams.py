"""Hyperparameters of a ``TrainingModule``: recorded from ``__init__``, checked to be plain data,
stored in the Trainer's checkpoints, and used to rebuild the module from one.

Plain data is what a checkpoint stores and reads back without running code (``torch.load`` with
``weights_only=True``), and what every logger can show: ``None``, bools, ints, floats, strings,
and lists, tuples and dicts with string keys of those. Anything else (a module, a tensor, a
function, a path) is refused with the argument's name and type; leave it out with
``save_hyperparameters(ignore=[...])`` and pass it to ``load_from_checkpoint`` as an override.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from torchrig.trainer.module import TrainingModule

__all__ = ["AttributeDict", "check_plain", "init_arguments", "load_from_checkpoint"]

#: The checkpoint entry that holds a module's hyperparameters (a plain value in ``state.pt``).
HPARAMS_KEY = "hparams"
_PLAIN_HINT = "numbers, strings, bools, None, and lists, tuples or dicts with str keys of those"

M = TypeVar("M", bound="TrainingModule")


class AttributeDict(dict[str, Any]):
    """A dict whose keys read as attributes too: ``module.hparams.lr``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no hyperparameter {name!r}; recorded: {sorted(self)}") from None


def check_plain(value: Any, where: str) -> None:
    """Raise ValueError naming ``where`` and the offending type unless ``value`` is plain data."""
    kind = type(value)  # exact types: a subclass (an enum, a numpy float, a namedtuple) would not load back
    if value is None or kind in (bool, int, float, str):
        return
    if kind in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if kind in (dict, AttributeDict):
        for key, item in value.items():
            if type(key) is not str:
                raise ValueError(f"{where} has the key {key!r} ({type(key).__name__}); hyperparameter keys are str")
            check_plain(item, f"{where}[{key!r}]")
        return
    shown = f"{kind.__module__}.{kind.__qualname__}"
    raise ValueError(f"{where} is a {shown}, not plain data ({_PLAIN_HINT})")


def init_arguments(module: TrainingModule, frame: FrameType | None, ignore: Iterable[str]) -> dict[str, Any]:
    """The arguments of the outermost ``__init__`` of ``module`` running at ``frame`` (the subclass's,
    when a base class's ``__init__`` calls ``save_hyperparameters()``), less ``ignore``."""
    found: FrameType | None = None
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is module:
        found, frame = frame, frame.f_back
    name = type(module).__name__
    if found is None:
        raise RuntimeError(f"{name}.save_hyperparameters() records the arguments of __init__: call it there")
    info = inspect.getargvalues(found)
    if info.varargs and found.f_locals.get(info.varargs):
        raise ValueError(
            f"{name}.__init__ got positional *{info.varargs}, which cannot be stored by name; "
            "take named arguments, or pass save_hyperparameters(ignore=[...]) and set hparams yourself"
        )
    values = {arg: found.f_locals[arg] for arg in info.args if arg != "self"}
    if info.keywords:
        values.update(found.f_locals.get(info.keywords) or {})
    skip = set(ignore)
    unknown = skip - set(values)
    if unknown:
        raise ValueError(f"save_hyperparameters(ignore={sorted(unknown)}): {name}.__init__ has no such argument")
    recorded = {k: v for k, v in values.items() if k not in skip}
    for key, value in recorded.items():
        try:
            check_plain(value, f"{name}.__init__ argument {key!r}")
        except ValueError as err:
            raise ValueError(
                f"{err}; save_hyperparameters(ignore=[{key!r}]) leaves it out (pass it to load_from_checkpoint)"
            ) from None
    return recorded


def load_from_checkpoint(cls: type[M], path: str | os.PathLike[str], overrides: Mapping[str, Any]) -> M:
    """``cls(**hparams, **overrides)`` with the weights of the checkpoint at ``path`` loaded.

    The checkpoint is read as ``rig.load`` reads it: every file checked against its SHA-256,
    tensors through safetensors (or DCP's shards, consolidated in this process), everything else
    with ``torch.load(weights_only=True)``, so no code in the files runs.
    """
    from torchrig.checkpoint import CheckpointError, module_weights, read_values

    values = read_values(path)
    saved = values.get(HPARAMS_KEY, {})
    if not isinstance(saved, dict):
        raise CheckpointError(f"the checkpoint {path} holds hparams as a {type(saved).__name__}, not a dict")
    try:
        check_plain(saved, f"the checkpoint {path}'s hparams")
    except ValueError as err:
        raise CheckpointError(f"{err}; refusing to build {cls.__name__} from it") from None
    kwargs = {**saved, **overrides}
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    unknown = [k for k in kwargs if k not in accepted or accepted[k].kind is inspect.Parameter.VAR_POSITIONAL]
    if unknown and not takes_any:
        where = "the checkpoint's hparams" if any(k in saved for k in unknown) else "the overrides"
        raise CheckpointError(
            f"{cls.__name__}.__init__ takes no argument {', '.join(map(repr, unknown))} (from {where} of {path}); "
            "load it with the class that saved it"
        )
    module = cls(**kwargs)
    weights = module_weights(path)
    if "module" not in weights:
        raise CheckpointError(f"{path} holds no 'module' weights (entries: {sorted(weights)}); save it with a Trainer")
    state = {k: t.to(_device_of(module)) for k, t in weights["module"].items()}
    try:
        module.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(f"the weights in {path} do not fit {cls.__name__}({_shown(kwargs)}): {err}") from None
    # What on_save_checkpoint added, as a Trainer's resume gives it (and Lightning's load_from_checkpoint).
    module.on_load_checkpoint(dict(values.get("callback_extras", {})))
    return module


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _shown(kwargs: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
