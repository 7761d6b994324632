"""The pure core: resource model, demands, the estimator, the policy and its ledger.

No event loop, no clock, no I/O: the live runtime and the simulator both decide with it."""
