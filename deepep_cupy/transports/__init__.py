"""Rail transports: how bytes travel between nodes (NCCL, MPI, torch.distributed, in-process)."""
