"""Starting processes on hosts: launchers (one host, Slurm, srun, mpiexec), the warm pool, the defaults.

Nothing here knows about ranks, cells or torch.distributed; ``world/`` builds a world on what these start.
"""
