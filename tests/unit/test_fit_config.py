"""%%dist_fit's question and answer without a forecast run: its config's checks and the verdict's arithmetic."""

from __future__ import annotations

import pytest

from nbdist.config import FitConfig, parse_bytes
from nbdist.errors import ConfigError
from nbdist.forecast.report import Forecast, Option


def test_sizes_read_as_people_write_them():
    assert parse_bytes("16GiB") == 16 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes(1024) == 1024
    for bad in ("16 lots", "-1GiB", "0", "GiB"):
        with pytest.raises(ConfigError, match="write it as 16GiB"):
            parse_bytes(bad)


def test_a_config_names_the_bad_value_and_the_fix():
    assert FitConfig(strategies="ddp,pp", world_sizes="2,4").strategies == ("ddp", "pp")
    # the 2-D mix is forecast when asked; the default is the four 1-D strategies
    assert FitConfig(strategies="fsdp+tp").strategies == ("fsdp+tp",)
    assert FitConfig().strategies == ("ddp", "fsdp", "tp", "pp")
    assert FitConfig(strategies="tp+fsdp").strategies == ("fsdp+tp",)
    with pytest.raises(ConfigError, match=r"strategy 'fsdp\+tpp' is not known; did you mean 'fsdp\+tp'"):
        FitConfig(strategies="fsdp+tpp")
    assert FitConfig(device="CUDA:1").device == "cuda:1" and FitConfig().device == "cpu"
    with pytest.raises(ConfigError, match=r"--device 'gpu' is not a device a forecast knows; write cpu, cuda or cuda:N"):
        FitConfig(device="gpu")
    with pytest.raises(ConfigError, match=r"strategy 'fsdb' is not known; did you mean 'fsdp'"):
        FitConfig(strategies="fsdb")
    with pytest.raises(ConfigError, match=r"-n 'two' is not a list of world sizes; write -n 2,4,8"):
        FitConfig(world_sizes="two")
    with pytest.raises(ConfigError, match=r"world size 0 is not a number of ranks"):
        FitConfig(world_sizes=(0,))
    with pytest.raises(ConfigError, match=r"microbatches 0 is not a whole number"):
        FitConfig(microbatches=0)


def _option(strategy: str, world: int, *peaks: int) -> Option:
    parts = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporaries", "buckets"), 0)
    return Option(strategy, world, {r: {"peak": p, "parts": parts} for r, p in enumerate(peaks)})


def test_the_smallest_world_that_fits_is_named_and_a_pipeline_s_peaking_stage():
    MiB = 2**20
    fc = Forecast(
        [_option("ddp", 2, 100 * MiB), _option("fsdp", 2, 60 * MiB), _option("pp", 4, 30 * MiB, 40 * MiB, 35 * MiB)],
        memory=64 * MiB,
    )
    assert (fc.best.strategy, fc.best.world) == ("fsdp", 2)
    assert fc.verdict() == "fits 64.0 MiB per rank: 2 ranks with fsdp (peak 60.0 MiB per rank)"
    assert fc.option("pp", 4).differ() == "rank 1 peaks; rank 0 holds 30.0 MiB"
    assert fc.peak("pp", 4, rank=2) == 35 * MiB and fc.peak("pp", 4) == 40 * MiB
    fc.memory = 20 * MiB
    assert fc.best is None
    assert fc.verdict().startswith("fits nowhere in 20.0 MiB per rank: the least is 40.0 MiB (pp at 4 ranks)")
    fc.options.append(Option("tp", 8, error="RuntimeError: no plan"))
    assert "not forecast: RuntimeError: no plan" in str(fc) and "<table>" in fc._repr_html_()
