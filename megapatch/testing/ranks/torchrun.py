"""``python -m megapatch.testing.ranks.torchrun [torchrun args]``: torchrun (``torch.distributed.run``,
unmodified) run as a child of the rank server named by ``$MPTEST_RANK_SERVER``, so it does not import
torch again; its workers (``-m megapatch.testing.ranks.cpu_launch``) forward to the server too.
Without the variable it is plain torchrun."""

import sys


def main() -> None:
    from megapatch.testing.ranks import rank_server

    rank_server.forward(pass_server_on=True)  # its workers forward too
    from torch.distributed.run import main as torchrun

    torchrun(sys.argv[1:])


if __name__ == "__main__":
    main()
