"""The servers' tensor cache seen from a load: which tensors a plan sends through it, and checking and
warming them before the load."""
