"""The world panel's actions route on a real Jupyter server (pytest-jupyter) with a real kernel and a real 2-rank
world started in it: ``restart`` brings back a killed rank and ``stop`` ends the world, each answered with its
result (``{"ok", "line"}``) from the kernel, not scraped from printed text; bad input is refused before it reaches
the kernel, and so is a request without Jupyter's token. Time bounds only catch hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
import tornado.httpclient

from nbdist.magics import panel
from nbdist.server import actions
from tests.helpers import wait_gone

pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"nbdist.server": True}}}


def test_the_server_and_the_kernel_know_the_same_actions():
    assert actions.ACTIONS == panel.ACTIONS
    assert actions.expression("restart", [5]) == (
        "__import__('nbdist.magics.panel', fromlist=['act']).act('restart', [5])"
    )


async def _post(jp_fetch, kernel_id, body):
    response = await jp_fetch(
        "nbdist", "api", "kernels", kernel_id, "actions", method="POST", body=json.dumps(body), request_timeout=300
    )
    return json.loads(response.body)


async def _run(jp_serverapp, kernel_id, code):
    """Run ``code`` in the kernel as a notebook would; its stdout (ends with the value of ``result``, if set)."""
    client = jp_serverapp.kernel_manager.get_kernel(kernel_id).client()
    client.start_channels()
    try:
        reply = await client.execute_interactive(
            code, timeout=240, output_hook=lambda msg: None, user_expressions={"r": "result"}
        )
    finally:
        client.stop_channels()
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply["content"]["user_expressions"]["r"].get("data", {}).get("text/plain")


async def test_restart_and_stop_are_answered_with_their_result(jp_fetch, jp_serverapp):
    response = await jp_fetch("api", "kernels", method="POST", body="{}")
    kernel_id = json.loads(response.body)["id"]
    pids: list[int] = []
    try:
        # no world yet: the kernel's own one line, not an error page
        said = await _post(jp_fetch, kernel_id, {"action": "stop"})
        assert said == {"ok": False, "line": said["line"]} and "no cluster is running" in said["line"], said
        pids = json.loads(
            (
                await _run(
                    jp_serverapp,
                    kernel_id,
                    "import json, nbdist\nc = nbdist.start(n=2, timeout=120)\n"
                    "result = json.dumps([r.pid for r in c.ranks])",
                )
            ).strip("'")
        )
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]], 30) == []
        said = await asyncio.wait_for(_post(jp_fetch, kernel_id, {"action": "restart", "ranks": [1]}), 300)
        assert said["ok"] and said["line"].startswith("rank(s) 1 restarted: world rebuilt in "), said
        after = json.loads(
            (
                await _run(
                    jp_serverapp,
                    kernel_id,
                    "c.run('x = dist.get_world_size()').raise_for_error()\n"
                    "result = json.dumps([c.pull('x'), [r.pid for r in c.ranks]])",
                )
            ).strip("'")
        )
        assert after[0] == [2, 2] and after[1][0] == pids[0] and after[1][1] != pids[1]  # rank 1 is a new process
        pids = after[1]
        said = await asyncio.wait_for(_post(jp_fetch, kernel_id, {"action": "stop"}), 120)
        assert said == {"ok": True, "line": "the world of 2 ranks stopped"}, said
        assert wait_gone(pids, 30) == []
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")
        wait_gone(pids, 30)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"action": "explode"}, "action 'explode' is not known; send one of restart, stop"),
        ({"action": "restart", "ranks": "1; import os"}, "ranks '1; import os' is not a list of ranks"),
        ({"action": "restart", "ranks": [-1]}, "ranks [-1] is not a list of ranks"),
    ],
)
async def test_bad_input_is_refused_before_the_kernel_sees_it(jp_fetch, body, message):
    response = await jp_fetch("api", "kernels", method="POST", body="{}")
    kernel_id = json.loads(response.body)["id"]
    try:
        with pytest.raises(tornado.httpclient.HTTPClientError) as refused:
            await _post(jp_fetch, kernel_id, body)
        assert refused.value.code == 400 and message in refused.value.response.body.decode()
        with pytest.raises(tornado.httpclient.HTTPClientError) as missing:
            await _post(jp_fetch, "not-a-kernel", {"action": "stop"})
        assert missing.value.code == 404
    finally:
        await jp_fetch("api", "kernels", kernel_id, method="DELETE")


async def test_a_request_without_the_token_is_refused(jp_fetch, jp_base_url, jp_http_port):
    del jp_fetch  # only for the server it starts
    url = f"http://localhost:{jp_http_port}{jp_base_url}nbdist/api/kernels/any/actions"
    client = tornado.httpclient.AsyncHTTPClient()
    with pytest.raises(tornado.httpclient.HTTPClientError) as refused:
        await client.fetch(url, method="POST", body=json.dumps({"action": "stop"}))
    assert refused.value.code == 403
