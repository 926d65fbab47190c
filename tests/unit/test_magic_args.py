"""Bad magic arguments: one line saying what is wrong and what to type instead (no cluster needed)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from nbdist import compat
from nbdist.magics.common import names_and_ranks


def _usage(ip, line):
    with pytest.raises(UsageError) as info:
        ip.run_line_magic(*line.split(" ", 1))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_unknown_backend_suggests(ip):
    assert "did you mean 'gloo'?" in _usage(ip, "dist_start --backend glo")


def test_unknown_launcher_suggests(ip):
    assert "did you mean 'local'?" in _usage(ip, "dist_start --launcher locl")


def test_bad_option_shows_usage(ip):
    msg = _usage(ip, "dist_start --bogus")
    assert "unrecognized arguments: --bogus" in msg and "type %dist_start [-n N]" in msg


def test_too_many_ranks_names_cores(ip):
    import os

    cores = os.cpu_count()
    msg = _usage(ip, f"dist_start -n {cores * 4}")
    assert f"use -n {cores}, or pass --oversubscribe" in msg


def test_dist_mode_word(ip):
    assert "takes on or off" in _usage(ip, "dist_mode maybe")


def test_no_cluster_says_how_to_start(ip, monkeypatch):
    import nbdist.cluster as api

    monkeypatch.setattr(api, "_CURRENT", None)  # no cluster, whatever ran before in this process
    assert "%dist_start -n 2" in _usage(ip, "dist_status ")


def test_names_and_ranks_parsing():
    assert names_and_ranks("a b --ranks 1", "dist_push") == (["a", "b"], "1")
    with pytest.raises(UsageError, match="not a variable name"):
        names_and_ranks("1x", "dist_push")
    with pytest.raises(UsageError, match="--ranks needs a value"):
        names_and_ranks("a --ranks", "dist_pull")


def test_dist_mode_transformer(ip):
    from nbdist.magics import _LOADED

    magics = _LOADED[id(ip)]
    ip.run_line_magic("dist_mode", "on")
    try:
        assert magics.mode_transform(["x = 1\n"]) == ["%%distributed\n", "x = 1\n"]
        assert magics.mode_transform(["%dist_mode off\n"]) == ["%dist_mode off\n"]
        assert magics.mode_transform(["%%rank 0\n", "x\n"]) == ["%%rank 0\n", "x\n"]
    finally:
        ip.run_line_magic("dist_mode", "off")
    assert magics.mode_transform not in ip.input_transformers_cleanup


def test_negative_max_restarts_is_refused_in_one_line(ip):
    msg = _usage(ip, "dist_start -n 2 --max-restarts -1")
    assert "max_restarts (-1) must be a whole number, 0 or more" in msg


def test_dist_where_without_a_cluster_says_how_to_start(ip, monkeypatch):
    import nbdist.cluster as api

    monkeypatch.setattr(api, "_CURRENT", None)  # no cluster, whatever ran before in this process
    assert "%dist_start -n 2" in _usage(ip, "dist_where ")


# Every option each magic takes, frozen (as torchtitan's test_no_new_cli_options.py does): adding or
# removing one is a deliberate change here, in the docs, and in the notebooks that teach it.
FROZEN = {
    # then each launcher's own options, in the order the launchers declare them (config/launchers.py)
    "dist_start": "-n --backend --launcher --timeout --oversubscribe --threads --no-pin --max-restarts --recover-from "
    "--min-ranks --debug-collectives --restart --keep --ip --start --nodes --partition --time --account --gpus-per-node --sbatch-arg "
    "--ranks-per-node --mpi-arg --address --gpus-per-rank",
    "distributed": "--ranks --timeout --noblock --quiet --each --setup",
    "rank": "spec --timeout --noblock --quiet --each --setup",
    "dist_restart": "--ranks",
    "dist_grow": "count",
    "dist_status": "--all",
    "dist_dashboard": "--ranks",
    "dist_where": "--all",
    "dist_run": "--ranks --timeout --noblock --quiet --each --setup script args",
    "dist_export": "path --cells --list --force",
    "dist_debug": "rank",
    "dist_attach": "name",
    "dist_equiv": "--steps --timeout function",
    "dist_why": "--timeout",
    "dist_track": "kind name --dir --project --uri",
}


def _magics():
    from nbdist.magics import DistMagics
    from nbdist.magics.common import with_launcher_options
    from nbdist.magics.scripts import ScriptMagics
    from nbdist.magics.track import TrackMagics

    found = {
        name: getattr(DistMagics, name, None) or getattr(ScriptMagics, name, None) or getattr(TrackMagics, name)
        for name in FROZEN
    }
    with_launcher_options(found["dist_start"])
    return found


def _options(func) -> list[str]:
    return [
        a.option_strings[0] if a.option_strings else a.dest
        for a in compat.parser_actions(func.parser)
        if a.dest != "help"
    ]


def test_no_magic_gains_or_loses_an_option_unnoticed():
    for name, func in _magics().items():
        assert _options(func) == FROZEN[name].split(), f"%{name}'s options changed: update FROZEN, the docs, USAGE"


def test_each_magics_usage_comes_from_its_parser_and_names_every_option_with_help():
    from nbdist.magics.common import usage

    for name, func in _magics().items():
        text = usage(func, cell=name in ("distributed", "rank"))
        for option in FROZEN[name].split():
            if option.startswith("-"):
                assert option in text, f"{option} missing from {text}"
        assert all(a.help for a in compat.parser_actions(func.parser)), f"an option of %{name} has no help"
    assert usage(_magics()["rank"], cell=True).startswith("%%rank [--timeout S]")


def test_the_usage_a_bad_line_shows_lists_every_option(ip):
    msg = _usage(ip, "dist_start --oversubscribe --no-pin --bogus")
    assert "[--oversubscribe] [--threads N] [--no-pin]" in msg, "the usage an error shows lists every option"


def test_each_dist_start_option_lands_on_its_start_config_field():
    """%dist_start hands its parsed options to nbdist.start as they are: each dest is a keyword StartConfig.of
    sorts into a section (the world, recovery, or a launcher's own options), but --restart, the magic's own (what
    to do with a world that runs already)."""
    from nbdist.config import RECOVERY, WORLD, StartConfig, launchers
    from nbdist.magics import DistMagics
    from nbdist.magics.common import with_launcher_options

    parser = with_launcher_options(DistMagics.dist_start).parser
    dests = {a.dest for a in compat.parser_actions(parser) if a.dest not in ("help", "restart")}
    keywords = {*WORLD, *RECOVERY, "launcher", *launchers.all_options()}
    assert dests <= keywords, dests - keywords
    assert set(launchers.all_options()) <= dests
    args = parser.parse_args(
        "-n 3 --oversubscribe --no-pin --launcher slurm --partition gpu --sbatch-arg=--mem=1G --time 5".split()
    )
    config = StartConfig.of(**{k: v for k, v in vars(args).items() if v is not None and k != "restart"})
    own = config.options
    assert (config.world.n, config.world.pin, config.launcher) == (3, False, "slurm")
    assert (own.partition, own.sbatch_args, own.time) == ("gpu", ["--mem=1G"], "5")  # type: ignore[attr-defined]
    assert parser.parse_args([]).pin is True


def test_a_comment_after_a_magic_is_read_as_a_shell_reads_it(ip):
    from nbdist.magics import DistMagics
    from nbdist.magics.common import parse, strip_comment

    assert strip_comment("-n 4 --oversubscribe   # four ranks on 2 cores") == "-n 4 --oversubscribe"
    assert strip_comment("--sbatch-arg=--comment=a#b") == "--sbatch-arg=--comment=a#b"  # not at a word's start
    assert strip_comment("--sbatch-arg '--comment # kept'") == "--sbatch-arg '--comment # kept'"  # quoted
    assert strip_comment("# all of it") == ""
    args = parse(DistMagics.dist_start, "-n 3 --oversubscribe  # three")
    assert (args.n, args.oversubscribe) == (3, True)
    assert names_and_ranks("a b  # two names", "dist_push") == (["a", "b"], None)
    assert "unrecognized arguments: --bogus" in _usage(ip, "dist_start --bogus  # a comment does not hide an error")
