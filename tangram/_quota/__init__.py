"""API quotas: per-key rate, token and concurrency limits behind an httpx client."""
