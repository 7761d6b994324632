"""CPU sandboxes: the pool, core sets, and the backends that run commands."""
