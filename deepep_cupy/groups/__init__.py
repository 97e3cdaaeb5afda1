"""Rank groups: mpi4py, torch.distributed and in-process groups, and the node shape of a group."""
