"""What every task's data shares: the exact-resume sampler (sampler.py) and the prepared folders' manifest checks (shards.py)."""
