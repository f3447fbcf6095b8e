"""Placeholder: being written (issue 3)."""
def agc(*a, **k): raise NotImplementedError
def unitwise_norm(*a, **k): raise NotImplementedError
