"""Placeholder: being written (issue 3)."""
from typing import NamedTuple
class DynamicLossScaleState(NamedTuple): pass
class StaticLossScaleState(NamedTuple): pass
def dynamic_loss_scale(*a, **k): raise NotImplementedError
def static_loss_scale(*a, **k): raise NotImplementedError
def loss_scale(*a, **k): raise NotImplementedError
def scaled_value_and_grad(*a, **k): raise NotImplementedError
