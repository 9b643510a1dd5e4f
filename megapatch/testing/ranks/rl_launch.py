"""``torchrun -m megapatch.testing.ranks.rl_launch train_rl.py ...``: the CPU launcher
(:mod:`megapatch.testing.ranks.cpu_launch`) with the dynamic engine's stand-ins around the script and
Megatron RL's (:mod:`megapatch.testing.stand_ins.rl_compat`) applied as ``megatron.rl`` is imported.
Run from the Megatron-LM checkout, as upstream's RL launch scripts are."""


def main(argv=None) -> None:
    from megapatch.testing.ranks import cpu_launch, rank_server

    rank_server.forward()  # under $MPTEST_RANK_SERVER: this process's __main__ runs as its child
    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_inference_workarounds
    from megapatch.testing.stand_ins.rl_compat import WORKAROUNDS

    with dynamic_inference_workarounds():
        cpu_launch.main(argv, extra=WORKAROUNDS)


if __name__ == "__main__":
    main()
