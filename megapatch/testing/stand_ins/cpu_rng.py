"""megatron-core's CUDA RNG on CPU, for ``cpu_compat``: the CUDA generator state that
``CudaRNGStatesTracker`` and activation checkpointing read and write, played by the CPU default
generator; the tracker's named states seeded on CPU generators; and the filter that drops
upstream ``fork()``'s "CPU RNG state changed" warning, meaningless with the CPU tracker."""

from __future__ import annotations

import logging

_RANDOM_MODULE = "megatron.core.tensor_parallel.random"
_CPU_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def _cpu_get_rng_state(_original):
    # Replaces random._get_cuda_rng_state (torch.cuda.random.get_rng_state /
    # torch.cuda.default_generators). Used by CudaRNGStatesTracker.fork,
    # _get_all_rng_states and activation checkpointing: on CPU every random op
    # draws from the CPU default generator, so that generator plays the role
    # of the "current CUDA generator".
    import torch

    def _get_cuda_rng_state(*_device_clone_graph_safe, **_kwargs):
        return torch.get_rng_state()

    return _get_cuda_rng_state


def _cpu_set_rng_state(_original):
    # Replaces random._set_cuda_rng_state (torch.cuda.default_generators[i]
    # .set_state via torch.cuda._lazy_call). Counterpart of _cpu_get_rng_state.
    import torch

    def _set_cuda_rng_state(new_state, *_device_graph_safe, **_kwargs):
        torch.set_rng_state(new_state)

    return _set_cuda_rng_state


def _cpu_tracker_add(_original):
    # Replaces CudaRNGStatesTracker.add, which seeds through
    # torch.cuda.get_rng_state()/torch.cuda.manual_seed() instead of the
    # _get/_set_cuda_rng_state helpers. Same bookkeeping and errors as
    # upstream; the named state is a CPU generator state seeded with ``seed``,
    # built on a private generator so the default generator is untouched.
    import torch

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception('seed {} already exists'.format(seed))
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception('cuda rng state {} already exists'.format(name))
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    return add


class _SuppressCpuRngWarning(logging.Filter):
    """Drops upstream fork()'s "CPU RNG state changed" warning.

    With the CPU tracker, random ops inside ``fork()`` legitimately advance the
    CPU generator (which holds the forked named state), so the upstream check
    that guards against CPU RNG use inside a CUDA fork is meaningless here.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return _CPU_RNG_WARNING not in record.getMessage()
