"""What every magic shares: the usage lines, argument parsing, and API errors as one-line UsageErrors."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, parse_argstring

from .. import cluster as api
from .. import compat
from ..cells import pointers
from ..config import did_you_mean, launchers
from ..errors import ClusterError, ConfigError, NbdistError, RankError

T = TypeVar("T")

# Usage of the magics that parse their line by hand; the others' comes from their parsers (``usage``).
USAGE = {
    "dist_mode": "%dist_mode on|off",
    "dist_push": "%dist_push NAME [NAME ...] [--ranks SPEC]",
    "dist_pull": "%dist_pull NAME [--ranks SPEC]",
}


def usage(func: Any, cell: bool = False) -> str:
    """A magic's usage on one line, from its own parser: it cannot drift from the options it takes."""
    text = " ".join(func.parser.format_usage().split()).removeprefix("::").strip()
    text = text.removeprefix("usage:").strip().replace(" [-h]", "")
    return "%" + text if cell else text


def cell_options(func: Any) -> Any:
    """The options every magic that runs a cell takes (%%distributed, %%rank), declared once."""
    for decorate in reversed(
        (
            argument("--timeout", type=float, default=None, metavar="S", help="seconds before ranks are released"),
            argument("--noblock", action="store_true", help="return at once; collect with .wait()"),
            argument("--quiet", action="store_true", help="show output of the first rank only"),
            argument("--each", action="store_true", help="every rank's lines as they are, not folded across ranks"),
            argument(
                "--setup", action="store_true", help="a cell that builds state: replayed after an automatic restart"
            ),
        )
    ):
        func = decorate(func)
    return func


def with_launcher_options(func: Any) -> Any:
    """``func`` (%dist_start) with a flag for every option the launchers known now declare, each saying which
    launchers take it, and ``--launcher``'s choices: a launcher installed as a plug-in brings its own."""
    parser = func.parser
    actions = {a.dest: a for a in compat.parser_actions(parser)}
    launchers.load()  # a package installed since the last look
    specs = launchers.known()
    chosen = actions["launcher"]
    chosen.metavar = "|".join(specs)
    chosen.help = (
        ", ".join(f"{spec.name} ({spec.summary})" for spec in specs.values())
        + "; default: srun inside a Slurm allocation when -n is left out, else local"
    )
    added = getattr(func, "__func__", func).__dict__.setdefault("launcher_options", set())  # for given_options
    for name, (opt, takers) in launchers.all_options().items():
        added.add(name)
        text = f"{opt.help} ({', '.join(spec.name for spec in takers)})"
        if name in actions:
            actions[name].help = text
        elif opt.many:
            parser.add_argument(opt.flag, dest=name, action="append", default=[], metavar=opt.metavar, help=text)
        elif opt.kind is bool:
            parser.add_argument(opt.flag, dest=name, action="store_true", default=None, help=text)
        else:
            parser.add_argument(opt.flag, dest=name, type=opt.kind, default=None, metavar=opt.metavar, help=text)
    return func


OWN = {"restart"}  # %dist_start's options that are the magic's own, not nbdist.start's


def given_options(func: Any, args: Any) -> dict[str, Any]:
    """The parsed options to hand to nbdist.start: a launcher's option only when it was given on the line (the
    parser keeps the flag of a launcher that was known once and is not now: its empty default is no option)."""
    made = getattr(func, "__func__", func).__dict__.get("launcher_options", set())
    return {k: v for k, v in vars(args).items() if k not in OWN and (k not in made or v not in (None, []))}


def strip_comment(line: str) -> str:
    """The line without a trailing ``# comment``, as a shell reads it: ``#`` starts a comment only at the
    start of a word and outside quotes (``%dist_start -n 4  # four ranks``; ``--sbatch-arg=--comment=a#b`` stays)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def parse(func: Any, line: str, cell: bool = False) -> Any:
    """The magic's arguments; a bad line is one UsageError naming what is wrong and the usage. ``-h`` or
    ``--help`` first: the magic's help is printed and None returned (the magic does nothing more)."""
    if strip_comment(line).split()[:1] in (["-h"], ["--help"]):
        print(func.parser.format_help().replace("::\n\n", "", 1).strip())
        return None
    try:
        return parse_argstring(func, strip_comment(line))
    except UsageError as exc:
        text = str(exc).replace("\n", " ").strip()
        raise UsageError(f"{text}; type {usage(func, cell)}") from None


def check_choice(value: str | None, choices: tuple[str, ...], what: str) -> None:
    if value is not None and value not in choices:
        raise UsageError(f"{what} {value!r} is not known; {did_you_mean(value, choices)}")


def names_and_ranks(line: str, magic: str) -> tuple[list[str], str | None]:
    words = shlex.split(strip_comment(line))
    ranks = None
    if "--ranks" in words:
        i = words.index("--ranks")
        if i + 1 >= len(words):
            raise UsageError(f"--ranks needs a value; type {USAGE[magic]}")
        ranks = words[i + 1]
        del words[i : i + 2]
    bad = [w for w in words if not w.isidentifier()]
    if bad or not words:
        raise UsageError(f"{(bad or [''])[0]!r} is not a variable name; type {USAGE[magic]}")
    return words, ranks


def call(fn: Callable[[], T]) -> T:
    """Run an API call; turn configuration and cluster errors into one-line UsageErrors."""
    try:
        return fn()
    except RankError:
        raise
    except (ConfigError, ClusterError) as exc:
        raise UsageError(str(exc)) from None
    except NbdistError as exc:  # pragma: no cover - any other nbdist error
        raise UsageError(str(exc)) from None


def show(result: Any, block: bool) -> Any:
    """What a magic that ran code on the ranks ends with: the error raised, or the notes printed."""
    if not block:
        print("running in the background; collect with nbdist.current().last.wait()")
        return result
    try:
        result.raise_for_error()
    except RankError as exc:  # the ranks' tracebacks say the notebook's count for the cell, as its prompt does
        exc.cell = pointers.this_kernel()[1].get("count")
        raise
    for note in result.notes:
        print(note)
    return None


def keep_running(old: Any, given: dict[str, Any], line: str) -> None:
    """``%dist_start`` while a world runs (the first cell run again): the same start keeps it, as it is, and says
    so; another start is a UsageError naming what differs and the two ways on. Nothing is stopped."""
    try:
        wanted = api.planned(**given)[0].flat()
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    running = old.config.flat()
    differ = [k for k in wanted if wanted[k] != running.get(k)]
    if not differ:
        print(
            f"a world of {old.world_size} ranks runs already, started the same way: kept as it is (its ranks' "
            "variables too). %dist_start --restart replaces it; %dist_stop ends it."
        )
        return
    said = ", ".join(
        f"{'-n' if k == 'n' else '--' + k.replace('_', '-')} {wanted[k]!r} (running: {running.get(k)!r})"
        for k in differ
    )
    raise UsageError(
        f"a world of {old.world_size} ranks runs already, started another way: {said}. Nothing was changed. "
        f"`%dist_start {' '.join([*line.split(), '--restart'])}` replaces it (its ranks' variables are lost), or "
        "%dist_stop ends it first."
    )
