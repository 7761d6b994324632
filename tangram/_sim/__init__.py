"""Simulation on a virtual clock: traces, the simulator, GPU residency, baselines, recording."""
