"""The ``attr-engine`` command line (also ``python -m attr_engine``).

Subcommands: ``demo`` (everything end to end on embedded data, no download), ``train-classifier``, ``train-aha``,
``explain`` (batch attribution of files and folders, resumable, shardable under torchrun), ``evaluate`` (a
leaderboard of methods), ``bench`` (kernel and engine micro-benchmarks), ``methods`` (the registry's methods),
``export`` (a trained AHA and its classifier as one ONNX / .pt2 serving file) and ``serve`` (maps over HTTP).

One error boundary serves every command (:func:`main`), so a command never ends in a traceback the user cannot act
on. The rule, whenever the error comes (while the command checks its settings or after its work has started):

- **exit 2, one line**: anything the user can fix - their command line, config file, inputs, options, model, data,
  device or resources. The library reports these as ``ValueError`` (a bad value, naming it), ``OSError`` (a
  missing or unwritable file, a full disk, an unreachable cluster or hub), ``ImportError`` (a missing extra) or
  ``MemoryError`` (an allocation the machine or its limits refuse); torch reports a few of them as
  ``RuntimeError`` (a kernel larger than the input, a shape a method cannot use, a device that cannot run the
  model, CUDA out of memory), recognised by their messages (:func:`user_error_message`). Every command first checks
  what it can before any work (flags, model and image sizes, option ranges, the cost budget of a method), so most
  such errors come within seconds; a run stopped later keeps what it finished, and the same command resumes it.
- **exit 1**: a run that finished with some maps not written (a non-finite map), or an internal error, a bug:
  one line that names the exception and asks to run again with ``--debug``.
- **exit 130**: Ctrl-C.

``--debug`` (or ``ATTR_ENGINE_DEBUG=1``) shows the full traceback instead of the one line, for either kind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main"]

PROG = "attr-engine"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is reported in one line instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and ``{command: subparser}``."""
    from attr_engine import __version__
    from attr_engine.cli import bench, demo, evaluate, explain, export, methods, serve, training
    from attr_engine.cli._common import add_cost_arg

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
        help="CPU threads torch may use (default: one per core, torch's choice; demo: 1); 1 is fastest on a busy "
        "machine",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands: dict[str, argparse.ArgumentParser] = {}
    for module in (demo, training, explain, evaluate, bench, methods, export, serve):
        commands.update(module.register(subparsers))
    for name, sub in commands.items():
        if name in ("explain", "evaluate"):  # the commands that run methods: their cost budget (cli._common)
            add_cost_arg(sub)
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


# torch's RuntimeErrors that are the user's to fix, by message: memory, the input against the model (a kernel
# larger than the image, a shape a layer or method cannot take) and the device (meta tensors, a device without the
# operator). Any other RuntimeError is taken for a bug. Each pattern comes with how the one line reads.
_USER_RUNTIME_ERRORS = (
    (r"out of memory|can't allocate memory|Tried to allocate|not enough memory", "not enough memory: {}"),
    (r"Kernel size can't be greater than actual input size|Output size is too small|input image is smaller",
     "the images are too small for this model: {} (raise --img-size)"),
    (r"meta tensors?|on the meta device|Cannot copy out of meta tensor", "the device cannot run the model: {}"),
    (r"Expected all tensors to be on the same device|not implemented for|No CUDA GPUs|CUDA error|MPS backend",
     "the device cannot run this: {}"),
    (r"shape|size mismatch|sizes? of tensors? must match|must match the size|mat1 and mat2|Expected .* dimension",
     "{}"),
)  # fmt: skip
# The exception classes that are the user's to fix (the library's way of reporting them, see the module
# docstring), by name: an actor's error crosses the process boundary as a type name and a message.
_USER_KINDS = frozenset(
    {"UsageError", "ValueError", "UnknownExplainerError", "OSError", "FileNotFoundError", "PermissionError",
     "IsADirectoryError", "NotADirectoryError", "ConnectionError", "ConnectionRefusedError", "TimeoutError",
     "ImportError", "ModuleNotFoundError"}
)  # fmt: skip
_MEMORY_KINDS = frozenset({"MemoryError", "_ArrayMemoryError", "OutOfMemoryError"})


def user_error_message(err: BaseException) -> str | None:
    """The one line for an error the user can fix (the rule of the module docstring), or None for a bug.

    An error is judged by its class and its ancestors' names; a :class:`~attr_engine.ray.RemoteWorkerError` by the
    class the actor raised (its ``remote_type``), so the Ray engine ends a command as the local one does.
    """
    import re

    remote = getattr(err, "remote_type", None)
    kinds = {remote} if remote else {t.__name__ for t in type(err).__mro__}
    message = _message(err)
    if kinds & _MEMORY_KINDS:
        return f"not enough memory: {message}"
    if kinds & {"RuntimeError", "NotImplementedError"} and not kinds & _USER_KINDS:
        for pattern, line in _USER_RUNTIME_ERRORS:
            if re.search(pattern, message):
                return line.format(message)
        return None
    return message if kinds & _USER_KINDS else None


@contextlib.contextmanager
def _quiet_libraries(no_progress: bool) -> Iterator[None]:
    """With ``--no-progress``, the libraries' progress bars off too: Hugging Face's (downloads, transformers'
    "Loading weights") and the ones pytorch-grad-cam draws with ``tqdm.tqdm`` (ScoreCAM, AblationCAM), which take
    no switch of their own. Everything is restored on exit."""
    if not no_progress:
        yield
        return
    import tqdm

    class Silent(tqdm.tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    with contextlib.ExitStack() as restore:
        saved = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub / transformers are imported
        restore.callback(_set_env, "HF_HUB_DISABLE_PROGRESS_BARS", saved)
        hub = sys.modules.get("huggingface_hub.utils")
        if hub is not None and not hub.are_progress_bars_disabled():
            hub.disable_progress_bars()
            restore.callback(hub.enable_progress_bars)
        hf_logging = sys.modules.get("transformers.utils.logging")
        if hf_logging is not None and hf_logging.is_progress_bar_enabled():
            hf_logging.disable_progress_bar()
            restore.callback(hf_logging.enable_progress_bar)
        restore.callback(setattr, tqdm, "tqdm", tqdm.tqdm)
        tqdm.tqdm = Silent  # the module attribute pytorch-grad-cam looks up at call time
        yield


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script passes it to ``sys.exit``)."""
    from attr_engine.cli._common import config_defaults, load_config_file, reset_phase

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
    with _one_line_warnings(), _quiet_libraries(getattr(args, "no_progress", False)):
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
        except Exception as err:  # the one boundary: see the module docstring for the rule
            if debug:
                raise
            return _report_error(prefix, err)


def _report_error(prefix: str, err: Exception) -> int:
    """Print ``err`` as one line; 2 for an error the user can fix, 1 for a bug (with the way to its traceback)."""
    from attr_engine.cli._common import is_working

    message = user_error_message(err)
    if message is not None:
        kept = "; what was finished before is kept" if is_working() else ""
        print(f"{prefix}: error: {message}{kept}", file=sys.stderr)
        return 2
    kind = getattr(err, "remote_type", None) or type(err).__name__
    print(
        f"{prefix}: internal error: {kind}: {_message(err)[:500]} (a bug: run again with --debug for the traceback "
        "and report it)",
        file=sys.stderr,
    )
    return 1
