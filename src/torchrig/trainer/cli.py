"""``CLI``: a command line for your training script, built from your classes' signatures.

``CLI(MyModule, MyData)`` gives ``fit``, ``validate``, ``test`` and ``predict`` subcommands.
Every ``__init__`` argument of the Trainer, the module and the datamodule becomes an option
(``--trainer.max_epochs``, ``--model.lr``, ``--data.batch_size``), typed and documented from
the signature and docstring by jsonargparse; ``--config file.yaml`` reads them from a file,
``--print_config`` prints the resolved configuration, and ``--ckpt_path`` starts from a
checkpoint. A wrong argument (an abbreviated option included) prints one ``error:`` line and a
hint to ``--help``, and exits with status 2; an error the run raises (a checkpoint that is not
there, a loop with no dataloader) prints ``error: ...`` and exits with status 1
(``JSONARGPARSE_DEBUG=true`` shows the traceback of either). ``fit`` saves the resolved
configuration as ``config.yaml`` in the logger's run directory.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter, Namespace

__all__ = ["CLI", "CONFIG_FILE", "SUBCOMMANDS"]

#: The file ``fit`` writes the resolved configuration to, in the logger's run directory.
CONFIG_FILE = "config.yaml"

SUBCOMMANDS: dict[str, str] = {
    "fit": "Train the model (validating as configured), optionally resuming from --ckpt_path.",
    "validate": "Run the validation loop once and print the metrics.",
    "test": "Run the test loop once and print the metrics.",
    "predict": "Run the predict loop and return the predictions.",
}


#: Sphinx roles and literals in docstrings (``:class:`~torchrig.Rig```, ````"cpu"````), for plain help.
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    """Docstring markup as plain text: ``:class:`~torchrig.Rig``` -> ``Rig``, ````x```` -> ``x``."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return _LITERAL.sub(r"\1", text)


class _PlainHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the docstrings' Sphinx markup rendered as plain text."""

    def _expand_help(self, action: Any) -> str:
        return plain_text(super()._expand_help(action))

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def add_text(self, text: str | None) -> None:  # group descriptions (the classes' docstrings)
        super().add_text(plain_text(text) if isinstance(text, str) else text)

    def start_section(self, heading: str | None) -> None:  # group titles (a docstring's first line)
        super().start_section(plain_text(heading) if isinstance(heading, str) else heading)


def _debug() -> bool:
    """``JSONARGPARSE_DEBUG=true``: tracebacks instead of one-line errors (jsonargparse's own switch)."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() in ("true", "1", "yes", "on")


class _Parser(ArgumentParser):
    """An ArgumentParser that refuses abbreviated options and says what is wrong first.

    argparse would take ``--trainer.max_epoch=3`` for ``--trainer.max_epochs``, and
    jsonargparse prints its error after the whole usage block; here the error is the first
    line, then one hint to ``--help``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _PlainHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or _debug():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {plain_text(message)}\n(run `{prog} --help` for the options)\n")
        self.exit(2)


class CLI:
    """Parse the command line into a Trainer, a module and a datamodule, and run a subcommand.

    Args:
        module_class: your :class:`~torchrig.TrainingModule` subclass (options ``--model.*``).
        datamodule_class: your :class:`~torchrig.DataModule` subclass (options ``--data.*``),
            or None when the module needs no datamodule.
        trainer_class: the Trainer class (options ``--trainer.*``).
        args: the arguments to parse instead of ``sys.argv[1:]``: a list of strings, or a dict
            (``{"fit": {"trainer": {...}}}`` with ``run=True``).
        run: with True, parse a subcommand and run it; with False, there are no subcommands:
            the classes are built and you call ``cli.trainer.fit(cli.model, ...)`` yourself.
        trainer_defaults: defaults for Trainer arguments (overridden by config and options).
        description: the ``--help`` text.

    After parsing, ``cli.trainer``, ``cli.model``, ``cli.datamodule``, ``cli.config`` (the parsed
    namespace), ``cli.subcommand`` and ``cli.result`` (what the subcommand returned) are set.

    Example:
        >>> # train.py:  from torchrig.cli import CLI;  CLI(MyModule, MyData)
        >>> # shell:     python train.py fit --config config.yaml --trainer.max_epochs=5
        >>> #            python train.py test --config config.yaml --ckpt_path=path/to/checkpoint
    """

    def __init__(
        self,
        module_class: type[Any],
        datamodule_class: type[Any] | None = None,
        *,
        trainer_class: type[Any] | None = None,
        args: Sequence[str] | dict[str, Any] | None = None,
        run: bool = True,
        trainer_defaults: dict[str, Any] | None = None,
        description: str | None = None,
    ) -> None:
        if trainer_class is None:
            from torchrig.trainer.trainer import Trainer

            trainer_class = Trainer
        for label, cls in (("module_class", module_class), ("datamodule_class", datamodule_class)):
            if cls is not None and not isinstance(cls, type):
                raise TypeError(
                    f"CLI({label}=...) takes a class, got an instance of {type(cls).__name__}; "
                    "pass the class, not an instance"
                )
        self.module_class = module_class
        self.datamodule_class = datamodule_class
        self.trainer_class = trainer_class
        self.trainer_defaults = dict(trainer_defaults or {})
        self.description = description or f"Train and evaluate {module_class.__name__} with torchrig."
        self.subcommand: str | None = None
        self.result: Any = None

        self.parser = self._build_parser(run)
        self.config: Namespace = self._parse(args)
        section = self.config[self.subcommand] if self.subcommand else self.config
        parser = self._subparsers[self.subcommand] if self.subcommand else self.parser
        try:
            seed = section.get("trainer.seed")
            if seed is not None:  # before the classes are built: the model's first weights follow it too
                from torchrig.rig import seed_everything

                seed_everything(seed)
            # ``instantiate`` replaced ``instantiate_classes`` in jsonargparse 4.49.
            instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
            self.config_init: Namespace = instantiate(section)
        except (ValueError, TypeError) as err:
            # A value that parses but that the classes reject (devices=2 on a one-device
            # accelerator): the same clean message and exit status 2 as a parse error.
            # JSONARGPARSE_DEBUG=true shows the traceback instead.
            parser.error(f"{type(err).__name__}: {err}", ex=err)
        self.trainer: Any = self.config_init["trainer"]
        self.model: Any = self.config_init["model"]
        self.datamodule: Any = self.config_init.get("data")
        if self.subcommand is not None:
            config_dir = self._save_config(parser, section) if self.subcommand == "fit" else None
            from torchrig.trainer.loggers import discarded_on_failure

            try:
                with discarded_on_failure(config_dir, CONFIG_FILE):  # a fit that failed before writing anything
                    self.result = self._run(self.subcommand, section.get("ckpt_path"))
            except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as err:
                # What the run refused (validate --ckpt_path=best from a new process, predict with
                # no predict_dataloader): the message, not a traceback through the loops. Other
                # errors (torch's RuntimeErrors, a bug) keep their traceback.
                if _debug():
                    raise
                sys.stderr.write(
                    f"error: {type(err).__name__}: {err}\n(set JSONARGPARSE_DEBUG=true to see where it was raised)\n"
                )
                raise SystemExit(1) from None

    # -- the parser ------------------------------------------------------------------------
    def _build_parser(self, run: bool) -> ArgumentParser:
        self._subparsers: dict[str, ArgumentParser] = {}
        if not run:
            parser = self._class_parser(self.description)
            return parser
        parser = _Parser(description=self.description)
        subcommands = parser.add_subcommands(required=True, dest="subcommand")
        for name, help_text in SUBCOMMANDS.items():
            sub = self._class_parser(help_text)
            sub.add_argument(
                "--ckpt_path",
                type=str | None,
                default=None,
                help="Checkpoint to start from: a path, or 'last'/'best' where the Trainer supports it.",
            )
            self._subparsers[name] = sub
            subcommands.add_subcommand(name, sub, help=help_text)
        return parser

    def _class_parser(self, description: str) -> ArgumentParser:
        parser = _Parser(description=description)
        # ActionConfigFile also adds --print_config.
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="A YAML/JSON config file (repeatable).")
        parser.add_class_arguments(self.trainer_class, "trainer", fail_untyped=False, sub_configs=True)
        if self.trainer_defaults:
            parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items()})
        parser.add_class_arguments(self.module_class, "model", fail_untyped=False, sub_configs=True)
        if self.datamodule_class is not None:
            parser.add_class_arguments(self.datamodule_class, "data", fail_untyped=False, sub_configs=True)
        return parser

    def _parse(self, args: Sequence[str] | dict[str, Any] | None) -> Namespace:
        if isinstance(args, dict):
            cfg = self.parser.parse_object(args)
        else:
            cfg = self.parser.parse_args(list(sys.argv[1:] if args is None else args))
        self.subcommand = cfg.get("subcommand")
        return cfg

    # -- running ---------------------------------------------------------------------------
    def _save_config(self, parser: ArgumentParser, section: Namespace) -> Path | None:
        """Write the resolved configuration of a fit next to its metrics: ``<log_dir>/config.yaml``
        (global rank zero; nothing without a logger), so ``--config`` can repeat the run. Returns
        the directory written to (None when nothing was written)."""
        logger = getattr(self.trainer, "logger", None)
        if logger is None or not getattr(self.trainer, "is_global_zero", True) or logger.log_dir is None:
            return None
        text = parser.dump(section, skip_none=False, skip_validation=True)
        (Path(logger.log_dir) / CONFIG_FILE).write_text(text)
        return Path(logger.log_dir)

    def _run(self, subcommand: str, ckpt_path: str | None) -> Any:
        method = getattr(self.trainer, subcommand)
        kwargs: dict[str, Any] = {"ckpt_path": ckpt_path}
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return method(self.model, **kwargs)
