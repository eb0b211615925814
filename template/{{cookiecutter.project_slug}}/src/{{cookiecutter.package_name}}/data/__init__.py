"""What every task's data shares: the exact-resume sampler (sampler.py) and the prepared-shard format (prepared.py)."""
