"""%%dist_fit and nbdist.fit against the real thing: each strategy's forecast (fake tensors, a fake process group, in a
process of its own) beside the same cell run for real on a 2-rank gloo world, counted by the same MemTracker.

The tolerance is 10% of each rank's peak, the issue's goal: the forecast runs the same step as the ranks do
(torch's DDP, FSDP2's fully_shard, parallelize_module; its own GPipe imitation against torch's ScheduleGPipe), so
what differs is what fake tensors cannot hold. Tensor parallelism misses one activation here (2%: the real
all-reduce's output, which a fake group's does not allocate). FSDP2's real peak varies from run to run: now and then
(1 run in 30 under a loaded machine here, one rank of the two), one unit's unsharded gradients, the input of a
reduce-scatter gloo has not yet let go of, are still alive at the peak as a temporary: 6.3% more on the MLP, 9.8% on
the Peek model. The forecast is the run without it, so `_assert_near` takes exactly that, and nothing else, out of the
real peak before it compares. How close the step time comes, on 2, 4 and 8 ranks and two models, is
benchmarks/fit.py's (timing belongs in benchmarks).
"""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.errors import ConfigError
from tests.helpers import run_cell

MLP = """
import torch
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    def forward(self, x):
        return x + self.mlp(x)
model = torch.nn.Sequential(*[Block() for _ in range(4)])
batch = (torch.randn(128, 64), torch.randn(128, 64))
"""
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def forecast():
    return nbdist.fit(MLP, world_sizes=(2,))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "pp"])
def test_each_rank_s_forecast_peak_is_what_the_real_step_holds(cluster, forecast, strategy):
    cluster.push({"_fit_src": MLP, "_fit_strategy": strategy})
    result = cluster.run(
        "from nbdist.forecast.real import measure_here\n_fit_real = measure_here(_fit_src, _fit_strategy, repeats=1)"
    )
    result.raise_for_error()
    real = cluster.pull("_fit_real")
    _assert_near(strategy, MLP, forecast.option(strategy, 2), real)
    parts = forecast.option(strategy, 2).ranks[0]["parts"]
    whole = sum(p.numel() * 4 for p in _model().parameters())
    # what each strategy keeps of the parameters at its peak: DDP a whole copy; FSDP its half of every block's shards
    # and one block gathered whole (the block running)
    held = {"ddp": whole, "fsdp": whole / 2 + whole / 4, "tp": None, "pp": None}[strategy]
    if held is not None:
        assert parts["parameters"] == pytest.approx(held, rel=0.01)
    if strategy == "ddp":  # the buckets: a second copy of the gradients, counted apart
        assert parts["buckets"] == whole
    if strategy == "pp":  # the stages differ, and the table says which rank peaks
        assert forecast.option("pp", 2).differ()


def _model(source=MLP):
    ns: dict = {}
    exec(source, ns)
    return ns["model"]


def _assert_near(strategy, source, option, real):
    """Each rank's forecast peak within TOLERANCE of the real step's. For FSDP2, a reduce-scatter's input that gloo
    let go of late (the module docstring) is taken out of the real peak first, and only when the real temporaries
    exceed the forecast's by exactly one unit's gradients (a child of the model, as fully_shard wraps it)."""
    units = {sum(p.numel() * p.element_size() for p in child.parameters()) for child in _model(source).children()}
    for rank in (0, 1):
        # a pipeline's stages differ; the other strategies' ranks are alike, and rank 0 is what is forecast
        mine = option.ranks[rank if strategy == "pp" else 0]
        want, got = real[rank]["peak"], mine["peak"]
        late = real[rank]["parts"]["temporaries"] - mine["parts"]["temporaries"]
        if strategy == "fsdp" and late in units - {0}:
            want -= late
        assert abs(got / want - 1) <= TOLERANCE, (strategy, rank, got, want, real[rank]["parts"], option.ranks)


def test_the_forecast_allocates_nothing_the_size_of_the_model(cluster):
    """80 GiB a rank for DDP (three 32768 x 32768 layers and Adam), on a machine with 24 GiB: forecast, not made (the
    operators too large to run are priced by the machine's measured rates)."""
    big = (
        "import torch\nmodel = torch.nn.Sequential(*[torch.nn.Linear(32768, 32768) for _ in range(3)])\n"
        "batch = torch.randn(64, 32768)\n"
    )
    fc = nbdist.fit(big, strategies="ddp,fsdp", world_sizes=(2, 8), memory="16GiB")
    assert fc.peak("ddp", 2) > 80 * 2**30
    assert fc.peak("fsdp", 8) < fc.peak("fsdp", 2) < fc.peak("ddp", 2)
    assert fc.best is None and fc.verdict().startswith("fits nowhere in 16.00 GiB per rank: the least is")
    assert "(fsdp at 8 ranks)" in fc.verdict()


def test_the_magic_prices_collectives_on_the_live_world_and_runs_its_setup_cells(cluster, ip):
    cluster.run(
        "import torch\nclass Wide(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.body = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))\n"
        "    def forward(self, x):\n        return self.body(x)\n",
        setup=True,
    ).raise_for_error()
    fc = run_cell(ip, "%%dist_fit -n 2 --strategies ddp,tp --memory 1GiB\nmodel = Wide()\nbatch = torch.randn(8, 32)\n")
    assert isinstance(fc, nbdist.forecast.Forecast)
    text = str(fc)
    assert "the live world's 2 ranks" in text, text
    assert fc.best is not None and fc.verdict().startswith("fits 1.00 GiB per rank: 2 ranks with"), text
    assert all(o.step_s > 0 for o in fc.options), text
    # the strategy that fits is watched: the world's cells give their dashboards its forecast; --watch none stops it
    assert fc.watched == fc.best.strategy and cluster.expect[2]["label"] == fc.watched, text
    assert cluster.expect[2]["step_s"] == pytest.approx(fc.best.step_s) and "dashboards now draw the" in text
    run_cell(ip, "%%dist_fit -n 2 --strategies ddp --watch none\nmodel = Wide()\nbatch = torch.randn(8, 32)\n")
    assert cluster.expect is None
    # the world is untouched: it still answers, with its two ranks
    assert cluster.run("_t = torch.ones(1); dist.all_reduce(_t)").raise_for_error()
    assert [float(t) for t in cluster.pull("_t")] == [2.0, 2.0]


def test_a_batch_of_the_wrong_shape_gives_the_model_s_error_on_its_forecast_s_line(cluster):
    cell = "import torch\nmodel = torch.nn.Linear(64, 8)\nbatch = torch.randn(4, 65)\n"
    fc = nbdist.fit(cell, strategies="ddp,fsdp", world_sizes=(2,))
    for opt in fc.options:
        assert opt.error is not None and "[4, 65] X [64, 8]" in opt.error, opt.error
    lines = str(fc).splitlines()
    assert any(ln.startswith("ddp") and "not forecast: the model (Linear): RuntimeError:" in ln for ln in lines), lines
    cell = "import torch\nmodel = torch.nn.Linear(64, 8)\nbatch = torch.randn(4, 64)\nraise ValueError('no data')\n"
    fc = nbdist.fit(cell, strategies="ddp", world_sizes=(2,))
    assert fc.options[0].error == "ValueError: no data (cell line 4)"
    # a model that is itself the layer reading its input's values cannot run as a box: named, with the way out
    peek = (
        "import torch\nclass Peek(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = torch.nn.Linear(8, 8)\n    def forward(self, x):\n        return self.w(x) if x.sum().item() > 0 "
        "else x\nmodel = Peek()\nbatch = torch.randn(4, 8)\n"
    )
    fc = nbdist.fit(peek, strategies="ddp", world_sizes=(2,))
    assert fc.options[0].error == (
        "the model (Peek): it reads a tensor's values (.item(), .tolist(), a branch on data), which fake tensors do not "
        "hold (cell line 7); move the code that reads them into a layer (a submodule): that layer runs alone"
    ), fc.options[0].error
    # a layer whose own code is wrong fails when it runs alone too: the model's own error, as torch says it
    wrong = "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(9, 4))\nbatch = torch.randn(4, 64)\n"
    fc = nbdist.fit(wrong, strategies="ddp", world_sizes=(2,))
    assert fc.options[0].error == "layer 1 (Linear): RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x8 and 9x4)"
    # a pipeline stage left with no weights is named, not the optimizer's "empty parameter list"
    fc = nbdist.fit(PEEK, strategies="ddp,pp", world_sizes=(4,))
    assert fc.option("pp", 4).error == (
        "pipeline stage 1 of 4 holds no weights (GELU): the model's layers split 4 ways leave it nothing to train; "
        "forecast pp at fewer ranks (-n 2) or give the model more layers."
    ), fc.option("pp", 4).error


PEEK = """
import torch
class Peek(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Linear(256, 256)
    def forward(self, x):
        return self.scale(x) * 2 if x.abs().sum().item() > 0 else x
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), Peek())
batch = (torch.randn(64, 256), torch.randn(64, 256))
"""


@pytest.fixture(scope="module")
def partial():
    return nbdist.fit(PEEK, world_sizes=(2,), memory="8MiB")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "pp"])
def test_a_layer_fake_tensors_cannot_follow_runs_alone_and_the_forecast_says_it_is_partial(cluster, partial, strategy):
    """Peek reads its input's values (.item()): under fake tensors it cannot run. It runs alone, for real, outside the
    tracker; the step around it is counted. Its inside (one 64 x 256 temporary before the * 2) is what is missed, so
    the forecast still comes within the issue's 10% of the same step run for real on the 2-rank world."""
    why = (
        "layer 3 (Peek): it reads a tensor's values (.item(), .tolist(), a branch on data), which fake tensors do not "
        "hold (cell line 8)"
    )
    opt = partial.option(strategy, 2)
    assert opt.error is None and opt.partial == [why], (opt.error, opt.partial)
    cluster.push({"_fit_src": PEEK, "_fit_strategy": strategy})
    result = cluster.run(
        "from nbdist.forecast.real import measure_here\n_fit_real = measure_here(_fit_src, _fit_strategy, repeats=1)"
    )
    result.raise_for_error()
    real = cluster.pull("_fit_real")
    _assert_near(strategy, PEEK, opt, real)
    # its parameters are the model's: they get gradients and optimizer state like any other layer's
    if strategy == "ddp":
        whole = 3 * 257 * 256 * 4
        assert opt.ranks[0]["parts"]["parameters"] == whole and opt.ranks[0]["parts"]["gradients"] == whole
        assert opt.ranks[0]["parts"]["optimizer"] >= 2 * whole
    text = str(partial)
    assert f"partial: {why}; so it ran alone, for real and outside the tracker" in text, text
    assert "partial: layer 3 (Peek) ran alone" in partial.rows()[1][-1]
    assert "; partial: layer 3 (Peek) not counted inside)" in partial.verdict(), partial.verdict()


def test_a_layer_too_large_to_run_alone_is_named_with_both_reasons(cluster):
    big = (
        "import torch\nclass Big(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = torch.nn.Linear(8192, 8192)\n    def forward(self, x):\n        return self.w(x) if "
        "x.sum().item() else x\nmodel = torch.nn.Sequential(torch.nn.Linear(8192, 8192), Big())\n"
        "batch = torch.randn(4, 8192)\n"
    )
    fc = nbdist.fit(big, strategies="ddp", world_sizes=(2,))
    assert fc.options[0].error == (
        "layer 1 (Big): it reads a tensor's values (.item(), .tolist(), a branch on data), which fake tensors do not "
        "hold (cell line 7); nor can it run alone: its parameters and inputs hold 256.2 MiB, more than the 256 MiB a "
        "layer may make for real here"
    ), fc.options[0].error


def test_bad_input_is_one_line_naming_the_value_and_the_fix(ip, cluster):
    with pytest.raises(UsageError, match=r"strategy 'dpp' is not known; did you mean"):
        run_cell(ip, "%%dist_fit --strategies dpp\nmodel = None\n")
    with pytest.raises(UsageError, match=r"--memory '16lots' is not a size; write it as 16GiB"):
        run_cell(ip, "%%dist_fit --memory 16lots\nmodel = None\n")
    with pytest.raises(UsageError, match=r"the cell defines no model and no batch; %%dist_fit runs the cell"):
        run_cell(ip, "%%dist_fit -n 2\nx = 1\n")
    with pytest.raises(UsageError, match=r"put the cell that defines `model` and `batch` under"):
        run_cell(ip, "%dist_fit -n 2")
    with pytest.raises(ConfigError, match=r"world size 0 is not a number of ranks"):
        nbdist.fit("x = 1", world_sizes=(0,))
    # a device that is not here: one line naming it and what the machine has, before anything runs
    with pytest.raises(UsageError, match=r"--device 'cuda:7' does not exist here: (torch \S+ \(a CPU build\) sees no "
                       r"CUDA device\. Forecast where the GPU is, or here with --device cpu --memory 80GiB|this machine "
                       r"has \d CUDA device)"):
        run_cell(ip, "%%dist_fit -n 2 --device cuda:7\nmodel = torch.nn.Linear(4, 4)\nbatch = torch.randn(2, 4)\n")
    assert cluster.run("_t = torch.ones(1); dist.all_reduce(_t)").raise_for_error()
    assert [float(t) for t in cluster.pull("_t")] == [2.0, 2.0]


def test_the_2d_mix_is_forecast_per_rank_against_the_real_step_on_four_ranks():
    """fsdp+tp as torchtitan builds it: tensor parallelism within each pair of ranks, FSDP2 across the pairs, on a
    2 x 2 mesh. The forecast (fake tensors and a fake group of 4) against the same step on a real 4-rank gloo world,
    within the issue's 10%; its collectives are priced on the groups they run in, not the world."""
    fc = nbdist.fit(MLP, strategies="fsdp+tp", world_sizes=(2, 4))
    assert fc.option("fsdp+tp", 2).error == (
        "fsdp+tp splits the ranks into groups of 2 for tensor parallelism and shards across the groups: it needs a "
        "world that is a multiple of 2, at least 4, not 2; forecast it at -n 4,8."
    )
    row = fc.option("fsdp+tp", 4).ranks[0]
    groups = {(kind, group) for kind, _, group in row["collectives"]}
    assert groups == {("all_gather", 2), ("reduce_scatter", 2), ("all_reduce", 2)}, groups
    with nbdist.start(n=4, oversubscribe=True, timeout=120) as world:
        world.push({"_fit_src": MLP})
        world.run(
            "from nbdist.forecast.real import measure_here\n_fit_real = measure_here(_fit_src, 'fsdp+tp', repeats=1)"
        ).raise_for_error()
        real = world.pull("_fit_real")
    for rank in range(4):
        want, got = real[rank]["peak"], fc.peak("fsdp+tp", 4, rank)
        assert abs(got / want - 1) <= TOLERANCE, (rank, got, want, row["parts"], real[rank]["parts"])
    # each rank holds a quarter of every parameter (half by TP, half of that by FSDP) and one block gathered
    whole = sum(p.numel() * 4 for p in _model().parameters())
    assert row["parts"]["parameters"] == pytest.approx(whole / 4 + whole / 4 / 2, rel=0.02), row["parts"]
