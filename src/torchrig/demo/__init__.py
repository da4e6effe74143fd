"""``torchrig demo``: a small CNN learns scikit-learn's handwritten digits with the Trainer.

The pieces are importable on their own:

- :mod:`torchrig.demo.data`: :class:`~torchrig.demo.data.DigitsDataModule` (1,797 8x8 images
  that ship inside scikit-learn; nothing is downloaded).
- :mod:`torchrig.demo.model`: :class:`~torchrig.demo.model.DigitsCNN`, a ``TrainingModule``.
- :mod:`torchrig.demo.plot`: the learning-curve PNG of any run directory with a ``metrics.csv``.

scikit-learn and matplotlib are the optional extra ``demo``: ``pip install -e '.[demo]'`` in a clone of torchrig
(it is not on the package index), or ``pip install scikit-learn matplotlib``.
"""

from __future__ import annotations

import importlib.util

INSTALL_HINT = "pip install scikit-learn matplotlib (or, in a clone of torchrig, pip install -e '.[demo]')"

#: import name -> the package that provides it
_EXTRAS = {"sklearn": "scikit-learn", "matplotlib": "matplotlib"}


class MissingExtraError(ImportError):
    """The optional ``demo`` extra (scikit-learn, matplotlib) is not installed."""


def require_extras(*modules: str) -> None:
    """Raise :class:`MissingExtraError` naming the install command if any of ``modules`` is missing.

    Example:
        >>> require_extras("sklearn", "matplotlib")  # silent when both are installed
    """
    wanted = modules or tuple(_EXTRAS)
    missing = [_EXTRAS.get(name, name) for name in wanted if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"the torchrig demo needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed; install the demo extra with: {INSTALL_HINT}"
        )


__all__ = ["INSTALL_HINT", "MissingExtraError", "require_extras"]
