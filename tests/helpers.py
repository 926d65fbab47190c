"""What several test modules share, in one place: running a notebook cell, waiting for processes to end or
for a file a rank writes (the tests synchronise on events, not on fixed sleeps), a free port, and the tiny
DDP model whose 2-rank training is checked against one process (also run inside a hub's kernel and on
two Slurm nodes)."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch


def run_cell(shell, code: str):
    """Run a notebook cell through IPython; raise the cell's error like Run All would stop."""
    result = shell.run_cell(code)
    result.raise_error()
    return result.result


def wait_gone(pids: list[int], within: float) -> list[int]:
    """Wait up to `within` seconds for these processes to end; return those still running.

    Reads /proc through nbdist.launch.procs.alive, which treats a process that ends between two looks
    (or a zombie) as gone instead of raising.
    """
    import time

    from nbdist.launch.procs import alive

    deadline = time.monotonic() + within
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p)]
    return left


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def poll(check, within: float, every: float = 0.2):
    """check() until it returns something truthy, and return that; fail after ``within`` s (a hang bound)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    pytest.fail(f"not within {within} s: {check.__doc__ or check}")


def rank_said(out: str, rank: int, text: str) -> bool:
    """Whether the notebook shows a line starting with ``text`` as said by ``rank``: its own line
    ``[rank R] text...``, or a line folded across ranks that names it (``[ranks 0-3] text...``)."""
    for line in out.splitlines():
        tag, sep, said = line.partition("] ")
        if not sep or not tag.startswith("[rank") or not said.startswith(text):
            continue
        spans = tag.removeprefix("[ranks ").removeprefix("[rank ").split(",")
        for span in spans:
            low, _, high = span.partition("-")
            if low.isdigit() and int(low) <= rank <= int(high or low):
                return True
    return False


def touch_code(path: os.PathLike | str, per_rank: bool = True) -> str:
    """Cell code that says "here" by creating ``path`` (``path-RANK`` with ``per_rank``), for ``wait_for``."""
    name = f"{str(path)!r} + f'-{{dist.get_rank()}}'" if per_rank else repr(str(path))
    return f"open({name}, 'w').close()\n"


def wait_for(*paths: os.PathLike | str, within: float = 60.0) -> None:
    """Until every path exists: a rank reached the line that creates it. ``within`` only bounds a hang."""
    deadline = time.monotonic() + within
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {within} s: {[str(p) for p in paths if not os.path.exists(p)]}")
        time.sleep(0.01)


def on_ranks(cluster, fn, *args, ranks=None, check: bool = True, quiet: bool = False, **kwargs):
    """Run ``fn(*args, **kwargs)`` on the ranks as one cell: the source of the module that defines it (a plain
    module such as tests/dist/programs.py: nothing is imported on the rank, so it runs on any host), then the
    call. The arguments travel with ``push``. Returns the cell's RunResult (raised on a failure unless
    ``check=False``) and each rank's return value, in rank order (None when the cell failed)."""
    import inspect

    source = inspect.getsource(inspect.getmodule(fn))
    cluster.push({"_on_ranks_args": (args, kwargs)}, ranks=ranks)
    call = f"_on_ranks_value = {fn.__name__}(*_on_ranks_args[0], **_on_ranks_args[1])\n"
    result = cluster.run(f"{source}\n{call}", ranks=ranks, quiet=quiet)
    if not check:
        return result, None
    result.raise_for_error()
    return result, cluster.pull("_on_ranks_value", ranks=ranks)


def check_ddp_against_one_process(cluster) -> None:
    """DDP over the cluster's ranks (2 or 4) for 5 steps equals one process on the combined batch (also across
    hosts)."""
    from tests.dist import programs

    b, steps, w = 4, 5, cluster.world_size
    _, replicas = on_ranks(cluster, programs.ddp_steps, b, steps)
    for other in replicas[1:]:
        for p0, p1 in zip(replicas[0], other, strict=True):
            assert torch.equal(p0, p1), "DDP replicas must stay bit-identical"
    model, data = programs.make_model(), programs.make_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = [list(range(r, 64, w)) for r in range(w)]  # rank r reads samples r, r+w, ...
    for step in range(steps):
        idx = [i for r in range(w) for i in shards[r][step * b : (step + 1) * b]]
        x, y = data[idx]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    # Same maths: DDP averages the w ranks' mean gradients, which is the mean over w * b.
    # Only float32 summation order differs, so a few ulps: 1e-6 absolute.
    for p_ddp, p_ref in zip(replicas[0], model.parameters(), strict=True):
        torch.testing.assert_close(p_ddp, p_ref.detach(), rtol=0, atol=1e-6)


class Kernel:
    """One IPython kernel driven as a notebook front end drives it."""

    def __init__(self, env: dict[str, str] | None = None, connection_file: str = "") -> None:
        """``connection_file``: named as a Jupyter server names it (``kernel-<id>.json``) where the test
        needs the kernel id the server would know; else jupyter_client's temporary name."""
        from jupyter_client.manager import KernelManager, start_new_kernel

        if not connection_file:
            self.km, self.kc = start_new_kernel(kernel_name="python3", **({"env": env} if env else {}))
            return
        self.km = KernelManager(kernel_name="python3", connection_file=connection_file)
        self.km.start_kernel(**({"env": env} if env else {}))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, answers: list | None = None, timeout: float = 120) -> tuple[dict, str, list[str]]:
        """Run a cell; answer each input request with the next of ``answers`` (a string, or a callable that
        acts, then returns what to type or None); the reply's content, the text shown, the prompts asked."""
        answers = list(answers or [])
        shown: list[str] = []
        asked: list[str] = []

        def output(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                shown.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                shown.append("\n".join(msg["content"]["traceback"]))

        def stdin(msg: dict) -> None:
            asked.append(msg["content"]["prompt"])
            answer = answers.pop(0) if answers else "c"
            answer = answer() if callable(answer) else answer  # acts first; None: nothing typed
            if answer is not None:
                self.kc.input(answer)

        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=output, stdin_hook=stdin, allow_stdin=True
        )
        return reply["content"], "".join(shown), asked

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        self.km.cleanup_resources()


class NotebookKernel:
    """A real ipykernel as the Jupyter server starts one (its connection file is kernel-<id>.json, so nbdist keeps
    its cells' transcripts), driven by a jupyter_client; ``run`` executes a cell as a page does, discarding its
    output, and gives the JSON value of ``expr`` (a user expression) when asked. Ends the kernel on ``close``."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        import uuid

        from jupyter_client import KernelManager
        from jupyter_core.paths import jupyter_runtime_dir

        os.makedirs(jupyter_runtime_dir(), exist_ok=True)
        path = os.path.join(jupyter_runtime_dir(), f"kernel-{uuid.uuid4()}.json")
        self.km = KernelManager(kernel_name="python3", connection_file=path)
        self.km.start_kernel(env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = int(self.run("import os", "os.getpid()"))

    def run(self, code: str, expr: str = "", timeout: float = 3600) -> object:
        import json

        reply = self.kc.execute_interactive(
            code, timeout=timeout, output_hook=lambda msg: None, user_expressions={"r": expr} if expr else None
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        if not expr:
            return None
        value = reply["content"]["user_expressions"]["r"]
        assert value["status"] == "ok", value
        return json.loads(eval(value["data"]["text/plain"])) if expr.startswith("json.dumps") else eval(
            value["data"]["text/plain"]
        )

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def stand_in_driver(folder) -> str:
    """A library named as NVIDIA's driver (libcuda.so.1, one cuInit that does nothing), built with cc in ``folder``:
    loading it maps the name the check before a fork looks for (engine/warm.accelerator_driver), with no GPU."""
    import pathlib
    import subprocess

    folder = pathlib.Path(folder)
    (folder / "driver.c").write_text("int cuInit(unsigned int flags) { return 0; }\n")
    lib = folder / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(folder / "driver.c")], check=True)
    return str(lib)


def wait_for_file(path) -> str:
    """Cell code: wait (at most 30 s) until the test creates ``path``; 'seen' or 'not seen'."""
    return (
        "import os, time\n"
        "_end = time.monotonic() + 30\n"
        f"while not os.path.exists({str(path)!r}) and time.monotonic() < _end:\n"
        "    time.sleep(0.01)\n"
        f"seen = 'seen' if os.path.exists({str(path)!r}) else 'not seen'\n"
    )
