"""One scheduler for many processes and hosts, on Ray.

The actor side: :mod:`._scheduler` (the runtime and the proxies' leases), :mod:`._placement`
(the host book), joined in :mod:`._cluster`. The worker side: :mod:`._proxy` (what a
process holds), :mod:`._hosts` (its handles on host agents), :mod:`._connect` (creating or
finding the actor). :mod:`._agent` is the per-host actor, a client like any worker; both
sides share only :mod:`._protocol`.
"""
