"""``POST {base_url}nbdist/api/kernels/<kernel id>/actions``, body ``{"action": "restart", "ranks": [5]}`` or
``{"action": "stop"}``: the world panel's buttons. The answer is the action's result, ``{"ok": bool, "line":
str}``, once the kernel has done it (right after the running cell, if one runs: a kernel takes one request at a
time; Interrupt is Jupyter's own ``/api/kernels/<id>/interrupt``).

The server asks the kernel itself, on its own channels: a silent request (no execution count, no history, in no
notebook's output) whose one user expression calls ``nbdist.magics.panel.act``; the result comes back in the
reply, typed, not read out of printed text. A request the kernel aborts (a failed cell before it aborts what
was queued behind it) is sent again, twice at most.

Safe by default: Jupyter's own authentication and its 'kernels' permission to execute; only kernels of this
server; the action and the ranks are checked here before anything reaches the kernel.
"""

from __future__ import annotations

import ast
import asyncio
import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

ACTIONS = ("restart", "stop")  # as nbdist.magics.panel.ACTIONS (a test checks): the server does not import it
TRIES = 3
WAIT_S = 24 * 3600.0  # the running cell may be long; the panel's request waits with it


def expression(action: str, ranks: list[int] | None) -> str:
    """The one expression the kernel evaluates: plain literals only, checked before."""
    return f"__import__('nbdist.magics.panel', fromlist=['act']).act({action!r}, {ranks!r})"


def checked(body: Any) -> tuple[str, list[int] | None]:
    """The action and its ranks from the request's body; HTTP 400 naming the value and the fix."""
    if not isinstance(body, dict) or body.get("action") not in ACTIONS:
        got = body.get("action") if isinstance(body, dict) else body
        raise web.HTTPError(400, f"action {got!r} is not known; send one of {', '.join(ACTIONS)}")
    ranks = body.get("ranks")
    if ranks is not None and not (
        isinstance(ranks, list)
        and ranks
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        raise web.HTTPError(400, f"ranks {ranks!r} is not a list of ranks; send e.g. [5], or leave it out")
    return body["action"], ranks


async def ask(client: Any, code: str) -> dict[str, Any]:
    """Evaluate ``code`` in the kernel as a silent request's user expression; its value, or why there is none."""
    for _ in range(TRIES):
        msg_id = client.execute("", silent=True, store_history=False, user_expressions={"result": code})
        while True:
            reply = await asyncio.wait_for(client.get_shell_msg(), WAIT_S)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        content = reply["content"]
        if content.get("status") == "aborted":
            continue
        result = content.get("user_expressions", {}).get("result", {})
        if result.get("status") != "ok":
            return {"ok": False, "line": f"the kernel could not do it: {result.get('ename')}: {result.get('evalue')}"}
        answer = ast.literal_eval(result["data"]["text/plain"])
        return {"ok": bool(answer["ok"]), "line": str(answer["line"])}
    return {"ok": False, "line": "the kernel aborted it three times; run the magic in the notebook"}


class ActionHandler(APIHandler):
    auth_resource = "kernels"

    @web.authenticated
    @authorized("execute")
    async def post(self, kernel_id: str) -> None:
        if kernel_id not in self.kernel_manager:
            raise web.HTTPError(404, f"no kernel {kernel_id} on this server")
        action, ranks = checked(self.get_json_body())
        client = self.kernel_manager.get_kernel(kernel_id).client()
        client.start_channels()
        try:
            answer = await ask(client, expression(action, ranks))
        finally:
            client.stop_channels()
        self.finish(json.dumps(answer))


def handlers(base_url: str) -> list[tuple[str, type]]:
    return [(url_path_join(base_url, r"nbdist/api/kernels/([^/]+)/actions"), ActionHandler)]
