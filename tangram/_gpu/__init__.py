"""GPU model services: the evict-on-execution pool, devices, torch and HTTP services."""
