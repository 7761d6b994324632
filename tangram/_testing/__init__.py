"""In-memory executors and test servers for users' suites (re-exported by tangram.testing)."""
