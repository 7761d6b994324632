"""The code reward: a dataset's tests judged in a sandbox by a harness the answer cannot
forge (``docs/rewards.md``).

Its own room, above the sandbox executor it runs in and below the framework adapters that
score with it: :mod:`._grade` is the host's side (labels, the call into the sandbox, the
verdict), :mod:`._in_sandbox` the program that runs inside the sandbox.
"""
