"""``torchrun -m megapatch.testing.ranks.dynamic_inference_launch SCRIPT.py ...``: the CPU launcher
(:mod:`megapatch.testing.ranks.cpu_launch`) with the dynamic inference engine's stand-ins
(:mod:`megapatch.testing.stand_ins.dynamic_inference_compat`) around the script too."""


def main(argv=None) -> None:
    from megapatch.testing.ranks import cpu_launch, rank_server

    rank_server.forward()  # under $MPTEST_RANK_SERVER: this process's __main__ runs as its child
    from megapatch.testing.stand_ins.dynamic_inference_compat import dynamic_inference_workarounds

    with dynamic_inference_workarounds():
        cpu_launch.main(argv)


if __name__ == "__main__":
    main()
