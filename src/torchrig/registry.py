"""A small named registry shared by accelerators and strategies.

A registry is a dict from a short name to a class (or factory) plus the keyword arguments it is
built with. ``register`` works as a call and as a decorator; third-party packages add entries
through a Python entry-point group that is read on first use.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RegistryEntry:
    """One registered name: what to build, with which keyword arguments, and a description."""

    name: str
    factory: Callable[..., Any]
    description: str = ""
    init_params: dict[str, Any] = field(default_factory=dict)
    builtin: bool = False

    def build(self, **overrides: Any) -> Any:
        return self.factory(**{**self.init_params, **overrides})


def _origin(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


class Registry(Generic[T]):
    """Names -> factories, with helpful errors.

    Args:
        kind: what the registry holds, used in messages ("accelerator", "strategy").
        entry_point_group: the entry-point group third-party packages use to register.
        hook: the classmethod name a registered class may define to register itself.

    Example:
        >>> from torchrig import ACCELERATOR_REGISTRY
        >>> "cpu" in ACCELERATOR_REGISTRY
        True
    """

    def __init__(self, *, kind: str, entry_point_group: str, hook: str) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.hook = hook
        self._entries: dict[str, RegistryEntry] = {}
        # Built-ins a user's entry replaced, so that removing the user's entry brings them back.
        self._shadowed: dict[str, RegistryEntry] = {}
        self._entry_points_loaded = False

    # -- writing ---------------------------------------------------------------------------
    def register(
        self,
        name: str,
        factory: Callable[..., T] | None = None,
        description: str = "",
        override: bool = False,
        **init_params: Any,
    ) -> Any:
        """Register ``factory`` under ``name``; without ``factory`` this returns a decorator.

        A name already taken by a user or third-party entry is an error unless ``override=True``.
        A built-in entry (for example the generic ``xpu``) may be replaced by a user's own class,
        and the same class registered again (a re-run notebook cell) simply replaces itself.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"the {self.kind} name must be a non-empty string, got {name!r}")
        if factory is None:

            def decorator(fn: Callable[..., T]) -> Callable[..., T]:
                self.register(name, fn, description=description, override=override, **init_params)
                return fn

            return decorator
        self._add(RegistryEntry(name, factory, description, dict(init_params)), override=override)
        return factory

    def _add(self, entry: RegistryEntry, *, override: bool) -> None:
        old = self._entries.get(entry.name)
        if old is not None and not (override or old.builtin) and _origin(old.factory) != _origin(entry.factory):
            raise ValueError(
                f"{self.kind} {entry.name!r} is already registered by {_origin(old.factory)}; "
                f"pass override=True to replace it with {_origin(entry.factory)}"
            )
        if old is not None and old.builtin and not entry.builtin:
            log.info("%s %r: %s replaces the built-in", self.kind, entry.name, _origin(entry.factory))
            self._shadowed[entry.name] = old
        self._entries[entry.name] = entry

    def register_builtin(self, name: str, factory: Callable[..., T], description: str = "", **init_params: Any) -> None:
        """Register one of torchrig's own entries; a user's registration may replace it."""
        self._entries[name] = RegistryEntry(name, factory, description, init_params, builtin=True)

    def remove(self, name: str) -> None:
        """Remove ``name``; an unknown name is an error that lists the known ones.

        Removing an entry that replaced a built-in of the same name (a user class registered as
        ``"xpu"``) brings the built-in back.
        """
        self._entry(name)
        del self._entries[name]
        builtin = self._shadowed.pop(name, None)
        if builtin is not None:
            self._entries[name] = builtin

    # -- reading ---------------------------------------------------------------------------
    def get(self, name: str, **overrides: Any) -> T:
        """Build the entry ``name`` with its stored init params (``overrides`` win)."""
        return self._entry(name).build(**overrides)  # type: ignore[no-any-return]

    def entry(self, name: str) -> RegistryEntry:
        """The raw entry for ``name``."""
        return self._entry(name)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load_entry_points()
        return sorted(self._entries)

    def describe(self) -> dict[str, str]:
        """``{name: description}`` for every entry."""
        self._load_entry_points()
        return {n: self._entries[n].description for n in sorted(self._entries)}

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __str__(self) -> str:
        rows = [f"  {n:<12} {d}" for n, d in self.describe().items()]
        return f"Registered {self.kind}s:\n" + "\n".join(rows)

    def unknown_name_message(self, name: str) -> str:
        known = self.names()
        msg = f"unknown {self.kind} {name!r}; known: {', '.join(known)}"
        close = difflib.get_close_matches(str(name).lower(), known, n=1, cutoff=0.5)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        return msg

    def _entry(self, name: str) -> RegistryEntry:
        self._load_entry_points()
        if name not in self._entries:
            raise ValueError(self.unknown_name_message(name))
        return self._entries[name]

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=self.entry_point_group):
            try:
                obj = ep.load()
            except Exception as err:  # a broken plugin must not break torchrig
                log.warning("could not load %s entry point %r: %s", self.kind, ep.name, err)
                continue
            try:
                self._register_plugin(ep.name, obj)
            except Exception as err:  # a name clash between plugins must not break torchrig either
                log.warning("could not register %s entry point %r: %s", self.kind, ep.name, err)

    def _register_plugin(self, name: str, obj: Any) -> None:
        """An entry point names a class with the hook, a function taking the registry, or a class."""
        if not isinstance(obj, type):
            obj(self)
            return
        hook = getattr(obj, self.hook, None)
        if callable(hook):
            hook(self)
        # A class that does not register itself (it inherits the no-op hook) goes in under the
        # entry point's own name.
        if not any(e.factory is obj for e in self._entries.values()):
            self.register(name, obj, description=(obj.__doc__ or "").strip().split("\n")[0])
