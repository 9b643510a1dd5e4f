"""CPU stand-ins, one module per upstream path (megatron-core, Megatron-LM's training loop, the
dynamic inference engine, the checkpoint converter, Megatron-Bridge), each listing the upstream
call it replaces and honouring its contract. No numerics change."""
