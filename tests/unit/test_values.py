"""Values that reach an sbatch script, a shell or a cell's source are Slurm's syntax on one line,
or they are refused in one line naming the value, before anything is written or started (issue 31)."""

from __future__ import annotations

import subprocess

import pytest

import nbdist
from nbdist.cells.history import History
from nbdist.config import StartConfig
from nbdist.errors import ConfigError
from nbdist.launch.hosts import batch_script
from nbdist.tools.export import export, sbatch_text
from nbdist.tools.runscript import script_cell
from nbdist.world.views import WorldShape

SLURM = {"launcher": "slurm", "n": 2}


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({**SLURM, "partition": "gpu\n#SBATCH --wrap=id"}, "--partition 'gpu\\n#SBATCH --wrap=id' is not a partition"),
        ({**SLURM, "partition": "gpu --wrap=id"}, "--partition 'gpu --wrap=id' is not a partition name"),
        ({**SLURM, "account": "proj;id"}, "--account 'proj;id' is not an account name"),
        ({**SLURM, "account": "$(id)"}, "--account '$(id)' is not an account name"),
        ({**SLURM, "time": "30\n#SBATCH --wrap=id"}, "--time '30\\n#SBATCH --wrap=id' is not a Slurm time limit"),
        ({**SLURM, "time": "1:00:00 && id"}, "--time '1:00:00 && id' is not a Slurm time limit"),
        (
            {**SLURM, "sbatch_args": ["--mem=8G\n#SBATCH --wrap=id"]},
            "--sbatch-arg '--mem=8G\\n#SBATCH --wrap=id' holds",
        ),
        ({**SLURM, "sbatch_args": ["--mem=8G\r"]}, "holds a line break or a NUL"),
        ({**SLURM, "sbatch_args": ["mem=8G"]}, "--sbatch-arg 'mem=8G' is not an sbatch option"),
        ({"launcher": "mpi", "n": 2, "mpi_args": ["--x\x00y"]}, "--mpi-arg '--x\\x00y' holds a line break or a NUL"),
        ({**SLURM, "ip": "10.0.0.1; id"}, "--ip '10.0.0.1; id' is not an address"),
    ],
)
def test_a_value_that_would_change_the_batch_script_is_refused_in_one_line(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        StartConfig.of(**kwargs)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value), "one line, the value shown escaped"
    assert "e.g." in str(info.value), "the error shows a value that works"


def test_nbdist_start_refuses_before_starting_anything():
    with pytest.raises(ConfigError, match="is not a partition name"):
        nbdist.start(n=2, launcher="slurm", partition="gpu\n#SBATCH --wrap=id")
    with pytest.raises(nbdist.ClusterError, match="no cluster is running"):
        nbdist.current()


@pytest.mark.parametrize(
    "kwargs, lines",
    [
        (
            {"partition": "gpu,debug", "time": "1-12:00:00", "account": "ml-team.2"},
            ["#SBATCH --partition=gpu,debug", "#SBATCH --time=1-12:00:00", "#SBATCH --account=ml-team.2"],
        ),
        (
            {"time": "UNLIMITED", "sbatch_args": ["--mem=8G", "--constraint=a100&nvlink"]},
            ["#SBATCH --time=UNLIMITED", "#SBATCH --mem=8G", "#SBATCH --constraint=a100&nvlink"],
        ),
    ],
)
def test_slurms_own_syntax_still_reaches_the_script(kwargs, lines):
    text = batch_script(StartConfig.of(**SLURM, **kwargs))
    for line in lines:
        assert line in text.splitlines()


def test_dist_run_refuses_a_path_or_argument_that_would_add_lines_to_the_cell(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert script_cell(script, ["--epochs", "1"]).count("\n") == 2  # its name line and its one call
    with pytest.raises(ConfigError, match=r"%dist_run '.*x\\nimport os.py' holds a line break"):
        script_cell(str(tmp_path / "x\nimport os.py"))
    with pytest.raises(ConfigError, match=r"%dist_run train.py argument '1\\nimport os' holds a line break"):
        script_cell(script, ["--epochs", "1\nimport os"])


@pytest.mark.parametrize("name", ["my train.py", "$(id).py", "a;b.py", "x\ny.py"])
def test_dist_export_refuses_a_file_name_the_sbatch_script_would_misread(tmp_path, name):
    with pytest.raises(ConfigError, match="its name may hold only letters") as info:
        export(History(), WorldShape("gloo", 2, 1, 1), tmp_path / name)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_the_exported_sbatch_script_reads_a_python_path_with_spaces_as_one_word(tmp_path):
    python = str(tmp_path / "my envs" / "bin" / "python")
    text = sbatch_text("train.py", 2, 1, "gloo", 1, python)
    line = next(ln for ln in text.splitlines() if ln.startswith("PYTHON="))
    done = subprocess.run(["bash", "-c", f'{line}\nprintf %s "$PYTHON"'], capture_output=True, text=True, check=True)
    assert done.stdout == python
