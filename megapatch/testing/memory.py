"""A meter of the tensor storage a block of torch ops allocates (CPU too, where torch keeps no
allocator statistics): the benchmark of the mode's attention and its memory test share it."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storage allocated by the ops run under it and still alive (each storage
    counted once, freed when the last tensor seen on it is)."""

    def __init__(self):
        super().__init__()
        self.refs, self.live, self.peak = {}, 0, 0

    def _drop(self, key):
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= self.refs.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                key = t.untyped_storage().data_ptr()
                if key not in self.refs:
                    self.refs[key] = [0, t.untyped_storage().nbytes()]
                    self.live += self.refs[key][1]
                    self.peak = max(self.peak, self.live)
                self.refs[key][0] += 1
                weakref.finalize(t, self._drop, key)
        return out
