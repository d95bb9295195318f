"""The command line's argument types and checks (``tvm-fusion``'s parser, option values,
output paths), apart from the commands in :mod:`tvm_fusion.tools.cli`.

Each check raises :class:`~tvm_fusion.errors.UsageError` (one line, status 2) or
``argparse.ArgumentTypeError`` (which the parser turns into one), before anything is compiled.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import TvmFusionError, UsageError

# largest static dim --shape takes; a bigger one is a typo, not a tensor that fits in memory
MAX_DIM = 2**31 - 1


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is a UsageError: one line, status 2 (see ``main``),
    not the usage text."""

    def error(self, message: str):
        raise UsageError(message)


def int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expects an integer >= {low}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


class TargetAction(argparse.Action):
    """``--target``: parsed here, once, by :func:`~tvm_fusion.target.parse_target` (what it
    refuses is a usage error); ``args.target`` is the Target that the commands hand down,
    ``args.target_spec`` the text as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..target import parse_target

        try:
            target = parse_target(values)
        except TvmFusionError as err:
            raise argparse.ArgumentError(self, str(err)) from None
        setattr(namespace, self.dest, target)
        namespace.target_spec = values


def command_target(args):
    """The command's target: ``--target`` as parsed, else the host CPU."""
    from ..target import host_target

    return args.target if args.target is not None else host_target()


def shape_arg(item: str) -> tuple[str, list[int | str]]:
    """``--shape x=1,128`` -> ``("x", [1, 128])``; a dim is an integer in 1..MAX_DIM or the name
    of a symbolic dim (``batch``)."""
    name, sep, dims = item.partition("=")
    if not sep or not name or not dims:
        raise argparse.ArgumentTypeError(f"expects NAME=D1,D2,..., got {item!r}")
    parsed: list[int | str] = []
    for text in (d.strip() for d in dims.split(",")):
        if text.lstrip("+-").isdigit():
            if not 1 <= int(text) <= MAX_DIM:
                raise argparse.ArgumentTypeError(
                    f"dims must be between 1 and 2**31-1 or a name, got {text} in {item!r}"
                )
            parsed.append(int(text))
        elif text.isidentifier():
            parsed.append(text)
        else:
            raise argparse.ArgumentTypeError(
                f"dims must be integers or names (e.g. batch), got {text!r} in {item!r}"
            )
    return name, parsed


def parse_shapes(items: Sequence[tuple[str, list[int | str]]] | None):
    """``--shape x=1,128 --shape mask=batch,128`` (parsed by :func:`shape_arg`) ->
    ``{"x": [1, 128], "mask": ["batch", 128]}``."""
    return dict(items) if items else None


def writable_dir(directory: Path, what: str) -> None:
    """Raise a UsageError unless a file can be created in ``directory`` (tried: ``os.access``
    says yes to root on read-only file systems and /sys)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tvm-fusion-probe-"):
            pass
    except OSError as err:
        raise UsageError(f"cannot write {what} in {directory}: {err.strerror or err}") from None


def check_output_file(path: str, what: str, make_parents: bool = False) -> Path:
    """Check before any work that ``path`` can be written as a file: not a directory, its
    directory exists (or, with ``make_parents``, can be created) and is writable."""
    out = Path(path)
    if out.is_dir():
        raise UsageError(f"{what} {path} is a directory; name a file")
    parent = out.parent
    while make_parents and not parent.exists() and not parent.is_symlink():
        parent = parent.parent  # created by the writer; the first existing one must be a dir
    if not parent.exists():
        raise UsageError(f"output directory does not exist: {parent}")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: {parent} is not a directory")
    writable_dir(parent, what)
    return out


def make_output_dir(path: str, what: str) -> Path:
    """Create the directory ``path`` (with its parents) now, before any work."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{what} {path} is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create {what} {path}: {err.strerror or err}") from None
    writable_dir(out, what)
    return out


def parse_dims(items: Sequence[str] | None) -> dict[str, int]:
    """``--dim batch=8 --dim seq=64`` -> ``{"batch": 8, "seq": 64}``."""
    dims: dict[str, int] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise UsageError(f"--dim expects NAME=N with N >= 1, got {item!r}")
        dims[name.strip()] = int(value)
    return dims


def workload_list(spec: str | None) -> list[str] | None:
    if not spec:
        return None
    from .. import models

    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        models.get(name)
    return names
