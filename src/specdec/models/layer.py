"""`Layer`: an nn.Module whose call is its forward, for the modules a decoding step runs.

A step of Gemma 3 270M calls ~150 modules (per layer: the block, its attention, MLP, norms and
projections). nn.Module's `__call__` goes through `_wrapped_call_impl` and `_call_impl`, which look
for hooks, forward pre-hooks and compile state at every call: a few microseconds each, a visible
share of a small model's int8 step, for hooks that specdec never registers. These
modules skip that machinery, so hooks registered on them do not run (autograd is unaffected:
training calls the same forward).
"""

from __future__ import annotations

from torch import nn


class Layer(nn.Module):
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
