"""Framework adapters (verl, OpenRLHF). Importing :mod:`tangram` never imports this package."""
