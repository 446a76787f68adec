"""Tensor parallelism: which slice each rank owns (shard.py), the process group and its
collectives (group.py), and the rank > 0 processes that run their slices (worker.py)."""
