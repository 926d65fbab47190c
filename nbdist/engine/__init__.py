"""Code that runs inside the engines: start-up wrappers and the per-rank runtime.

``python -m nbdist.engine`` starts one engine (torch preloaded, parent watched);
``python -m nbdist.engine.controller`` starts the controller (parent watched).
"""
