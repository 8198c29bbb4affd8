"""The ``attr-engine`` command line (also ``python -m attr_engine``).

Subcommands: ``demo`` (everything end to end on embedded data, no download), ``train-classifier``, ``train-aha``,
``explain`` (batch attribution of files and folders, resumable, shardable under torchrun), ``evaluate`` (a
leaderboard of methods), ``bench`` (kernel and engine micro-benchmarks), ``methods`` (the registry's methods) and
``serve`` (maps over HTTP).

A user mistake (unknown model or method, missing checkpoint, unreadable image, empty folder, output not writable)
ends with one line on stderr and a non-zero exit status. One rule decides which: every command first checks its
command line, config file, model, checkpoints, data, method options and output directory, then starts its work;
an error before that point exits 2 (a bad command line or setting), an error after it exits 1 (a failure while
running), and Ctrl-C exits 130. ``--debug`` (or ``ATTR_ENGINE_DEBUG=1``) shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

__all__ = ["main"]

PROG = "attr-engine"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is reported in one line instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and ``{command: subparser}``."""
    from attr_engine import __version__
    from attr_engine.cli import bench, demo, evaluate, explain, methods, serve, training

    parser = _Parser(
        prog=PROG,
        description="Pixel-level attribution for image classifiers: AHA and Semantic Pullback.",
        epilog="Run 'attr-engine COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="CPU threads torch may use (default: torch's choice, one per core); 1 is fastest on a busy machine",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, argparse.ArgumentParser] = {}
    for module in (demo, training, explain, evaluate, bench, methods, serve):
        commands.update(module.register(subparsers))
    for sub in commands.values():
        sub.add_argument(
            "--config",
            metavar="FILE",
            help="YAML or JSON file of option values (keys are option names); flags given here override it",
        )
    return parser, commands


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Library warnings (skipped images, layers the soft adjoint does not know) as one readable line each."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"{PROG}: warning: {message}", file=sys.stderr if file is None else file)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _message(err: BaseException) -> str:
    text = str(err) if str(err) else type(err).__name__
    if isinstance(err, OSError) and err.filename and err.strerror:
        text = f"{err.strerror}: {err.filename}"
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script passes it to ``sys.exit``)."""
    from attr_engine.cli._common import UsageError, config_defaults, is_working, load_config_file, reset_phase

    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    debug = args.debug or os.environ.get("ATTR_ENGINE_DEBUG", "") not in ("", "0")
    prefix = f"{PROG} {args.command}"
    if args.threads is not None:
        if args.threads < 1:
            print(f"{PROG}: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        import torch

        torch.set_num_threads(args.threads)
    reset_phase()
    with _one_line_warnings():
        try:
            if args.config:
                sub = commands[args.command]
                sections = getattr(args, "_config_sections", ())
                sub.set_defaults(**config_defaults(sub, load_config_file(args.config), sections=sections))
                args = parser.parse_args(argv)
            return int(args.run(args) or 0)
        except KeyboardInterrupt:
            print(
                f"\n{prefix}: interrupted; finished outputs are kept, run the command again to resume", file=sys.stderr
            )
            return 130
        except UsageError as err:
            if debug:
                raise
            print(f"{prefix}: error: {_message(err)}", file=sys.stderr)
            return 2
        except (ValueError, OSError, ImportError) as err:
            # The library reports bad inputs as ValueError naming the culprit, missing files as FileNotFoundError,
            # permissions as PermissionError: all are the user's to fix, so one line is the whole story. Raised
            # while the command was still checking its settings it is a bad setting (2), later a failure (1).
            if debug:
                raise
            print(f"{prefix}: error: {_message(err)}", file=sys.stderr)
            return 1 if is_working() else 2
