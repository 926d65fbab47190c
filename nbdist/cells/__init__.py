"""Cells: send one to the ranks and follow it (run), when to release (release), how its output is shown
(output), and the cells that ran (history). What a cell returns is ``nbdist.results``.
"""
