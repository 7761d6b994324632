"""What RL frameworks' adapters build on: the config file and the schedulers it opens."""
