"""The processes a person starts: the CLI, the control worker, node agents, the local stack."""
