"""What RL frameworks' adapters build on: the config file (``_config``), the scheduler it
names (``_open``) and the per-loop sessions with their pools (``_session``), imported in
that one direction. Adapters reach it through :mod:`tangram.integrations` and
:mod:`tangram.config`."""
