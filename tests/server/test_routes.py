"""nbdist's server extension on a real Jupyter server (pytest-jupyter) with a real kernel: the route
gives a kernel's distributed cells as a page shows them, only with Jupyter's authentication, only for
kernels of this server and only for worlds this user owns."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import tornado.httpclient

from nbdist.cells import pointers as P
from nbdist.cells import transcript as T

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"nbdist.server": True}}}


@contextlib.asynccontextmanager
async def _kernel(jp_fetch):
    """A real kernel of this server (pytest-jupyter's fixtures cannot be async)."""
    response = await jp_fetch("api", "kernels", method="POST", body="{}")
    kid = json.loads(response.body)["id"]
    try:
        yield kid
    finally:
        await jp_fetch("api", "kernels", kid, method="DELETE")


def _world(path, kernel_id: str, running: bool = False):
    os.makedirs(path, mode=0o700)
    kept = T.Transcript.open(str(path), {"id": "cell-1", "count": 2, "code": "%%distributed\ntrain()"})
    kept.output({"output_type": "stream", "name": "stdout", "text": "[rank 0] STEP 0\n"})
    kept.metrics(0, [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}])
    kept.metrics(1, [{"step": 0, "loss": 1.1}, {"step": 1, "loss": 0.6}])
    kept.output({"output_type": "stream", "name": "stdout", "text": "[rank 0] STEP 1\n"})
    kept.states({0: "idle", 1: "idle"})
    if running:
        kept.flush()
    else:
        kept.end()
    P.point(str(path), kernel_id)


async def test_a_kernels_cells_as_a_page_shows_them(jp_fetch, tmp_path):
    async with _kernel(jp_fetch) as kernel_id:
        await _shows_them(jp_fetch, kernel_id, tmp_path)


async def _shows_them(jp_fetch, kernel_id, tmp_path):
    response = await jp_fetch("nbdist", "api", "kernels", kernel_id, "cells")
    assert json.loads(response.body) == {"cells": []}  # a kernel that ran no distributed cell
    _world(tmp_path / "world", kernel_id, running=True)
    [cell] = json.loads((await jp_fetch("nbdist", "api", "kernels", kernel_id, "cells")).body)["cells"]
    assert (cell["id"], cell["count"], cell["running"]) == ("cell-1", 2, True)
    first, figure, second = cell["outputs"]  # the dashboard where it appeared, between the lines
    assert first["text"] == "[rank 0] STEP 0\n" and second["text"] == "[rank 0] STEP 1\n"
    plotly = figure["data"]["application/vnd.plotly.v1+json"]
    assert "step 1" in plotly["layout"]["title"]["text"] and "ranks 0,1: idle" in plotly["layout"]["title"]["text"]
    assert max(len(t.get("x") or []) for t in plotly["data"]) == 2
    version = cell["version"]
    with open(T.cells(str(tmp_path / "world"))[0], "a") as fh:
        fh.write('{"end": 1}\n')
    [cell] = json.loads((await jp_fetch("nbdist", "api", "kernels", kernel_id, "cells")).body)["cells"]
    assert not cell["running"] and cell["version"] > version


async def test_unauthenticated_requests_are_refused(jp_fetch, jp_base_url, jp_http_port, tmp_path):
    async with _kernel(jp_fetch) as kernel_id:
        await _refused(jp_base_url, jp_http_port, kernel_id, tmp_path)


async def _refused(jp_base_url, jp_http_port, kernel_id, tmp_path):
    _world(tmp_path / "world", kernel_id)
    url = f"http://localhost:{jp_http_port}{jp_base_url}nbdist/api/kernels/{kernel_id}/cells"
    client = tornado.httpclient.AsyncHTTPClient()
    with pytest.raises(tornado.httpclient.HTTPClientError) as refused:
        await client.fetch(url)  # no token
    assert refused.value.code == 403
    with pytest.raises(tornado.httpclient.HTTPClientError) as refused:
        await client.fetch(url, headers={"Authorization": "token not-the-token"})
    assert refused.value.code == 403


async def test_only_this_servers_kernels_and_this_users_worlds(jp_fetch, tmp_path):
    async with _kernel(jp_fetch) as kernel_id:
        await _only_theirs(jp_fetch, kernel_id, tmp_path)


async def _only_theirs(jp_fetch, kernel_id, tmp_path):
    with pytest.raises(tornado.httpclient.HTTPClientError) as missing:
        await jp_fetch("nbdist", "api", "kernels", "not-a-kernel", "cells")
    assert missing.value.code == 404
    world = tmp_path / "world"
    _world(world, kernel_id)
    os.chmod(world, 0o755)  # readable by others: not a world nbdist made
    with pytest.raises(tornado.httpclient.HTTPClientError) as refused:
        await jp_fetch("nbdist", "api", "kernels", kernel_id, "cells")
    assert refused.value.code == 403
    os.chmod(world, 0o700)
    if os.geteuid() == 0:
        os.chown(world, 65534, 65534)  # another user's (nobody's) world
        with pytest.raises(tornado.httpclient.HTTPClientError) as refused:
            await jp_fetch("nbdist", "api", "kernels", kernel_id, "cells")
        assert refused.value.code == 403
        os.chown(world, 0, 0)
    assert (await jp_fetch("nbdist", "api", "kernels", kernel_id, "cells")).code == 200


def _ranks_file(world, rows):
    with open(world / "ranks.json", "w") as fh:
        json.dump({"ranks": rows, "at": 0}, fh)


async def test_the_world_panels_route_names_each_rank_groups_many_and_the_slowest(jp_fetch, tmp_path):
    async with _kernel(jp_fetch) as kernel_id:
        world = tmp_path / "world"
        _world(world, kernel_id, running=True)
        me = os.getpid()  # not an engine: its memory is not a rank's
        _ranks_file(
            world,
            [
                {"rank": 0, "state": "busy", "cell": "train()", "line": 7, "host": "h", "pid": me, "device": "cpu"},
                {"rank": 1, "state": "dead", "cell": "train()", "line": None, "host": "h", "pid": 0, "device": "cpu"},
            ],
        )
        kept = T.Transcript(T.cells(str(world))[0], open(T.cells(str(world))[0], "a"))  # noqa: SIM115
        for step in range(2, 12):  # rank 1 takes 30% longer, most of it waiting for data
            kept.metrics(0, [{"step": step, "time/step_s": 0.010, "comm/time_s": 0.002}])
            kept.metrics(1, [{"step": step, "time/step_s": 0.013, "comm/time_s": 0.002, "time/data_s": 0.008}])
        kept.end()
        [found] = json.loads((await jp_fetch("nbdist", "api", "worlds")).body)["worlds"]
        assert found["kernel"] == kernel_id and [r["state"] for r in found["ranks"]] == ["busy", "dead"]
        assert found["ranks"][0]["line"] == 7 and found["ranks"][0]["rss_MiB"] is None  # a pid, but not a rank's
        assert found["ranks"][0]["gpu_MiB"] is None  # nor a GPU's (tests/dist/test_gpu.py shows one)
        assert found["groups"] == []  # 2 ranks: one row each
        assert found["slowest"]["rank"] == 1 and found["slowest"]["holds"] == "data wait"
        assert found["slowest"]["pct"] == pytest.approx(30, abs=1)
        many = [
            {"rank": r, "state": "busy", "line": 7, "host": "h", "pid": 0, "device": "cpu"} for r in range(16)
        ]
        many[15] = {**many[15], "state": "dead", "line": None}
        _ranks_file(world, many)
        [found] = json.loads((await jp_fetch("nbdist", "api", "worlds")).body)["worlds"]
        assert found["groups"] == ["ranks 0-14: busy at cell line 7 on h (cpu)", "rank 15: dead on h (cpu)"]
        os.chmod(world, 0o755)
        assert json.loads((await jp_fetch("nbdist", "api", "worlds")).body)["worlds"] == []  # not this user's
