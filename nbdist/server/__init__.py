"""nbdist's Jupyter server extension: what a distributed cell showed, for a page opened after it began.

Jupyter loads it from the configuration the wheel installs (``jupyter_server_config.d/nbdist.json``).
It adds three authenticated routes and listens on nothing new: routes.py (a kernel's distributed cells,
for a page opened later), worlds.py (each kernel's world, for the world panel) and actions.py (the panel's
buttons, answered with their result).
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "nbdist.server"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from ..cells.pointers import prune
    from . import actions, routes, worlds

    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", routes.handlers(base) + worlds.handlers(base) + actions.handlers(base))
    prune(set(serverapp.kernel_manager.list_kernel_ids()))  # pointers of kernels gone with an earlier server
    serverapp.log.info("nbdist: a distributed cell's output is kept for pages opened later")


load_jupyter_server_extension = _load_jupyter_server_extension  # the name older servers call
