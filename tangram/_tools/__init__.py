"""The ``tangram`` command and the tools behind it; the library never imports this package."""
