"""operations: every change to a node (see `operations.layer`)."""

BUSY_GRACE = 1.0  # seconds a client connection may last and still be a probe passing by, not a model
