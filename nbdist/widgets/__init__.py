"""Notebook views of cluster state (the live dashboard). Widgets draw what they are given: they import
nothing of nbdist's and never torch. A rank's state arrives as its word (``RankState``'s values), and its
colour with the palette the dashboard is given (``results.STATE_COLOURS``, the one vocabulary)."""
