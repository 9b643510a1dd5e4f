"""The rank harness and the launchers: ``run_ranks`` (one process per rank under real megatron-core), the
process that forks them preloaded, and the CPU launchers of Megatron-LM's scripts and converter."""
