"""What the magics offer beyond a cell, each built on ``Cluster``'s public API: the bandwidth sweep
(bench, benchfns on the ranks), a torchrun script as a cell (scripts), the notebook as a torchrun job (export).
"""
