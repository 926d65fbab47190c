"""A world's life: who is in it and every change to it (membership), a cell's way through its ranks
(cellpath), recovery when a rank dies during a cell (recovery, peer_recovery) and growing it (grow).

Below the Cluster, above ``cells/``, ``world/`` and ``launch/``: the Cluster is given nothing back from here,
and nothing below imports this folder. Within it the arrows run cellpath -> grow -> recovery -> peer_recovery,
membership; ``Membership`` calls nothing in this folder.
"""
