"""The world: the set of engines with their ranks (engineset), the process group on them (rendezvous),
and what it looks like now (views: status rows, where each rank is).
"""
