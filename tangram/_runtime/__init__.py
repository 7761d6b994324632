"""The live runtime: the scheduler task, leases and their lifecycle, instruments."""
