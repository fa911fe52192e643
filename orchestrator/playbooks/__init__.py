"""playbooks."""
