"""One scheduler for many processes and hosts, on Ray: the scheduler actor, host agents, proxies."""
