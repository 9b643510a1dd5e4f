"""``python -m megapatch.testing.cpu_launch`` keeps working for launch commands written before the
launchers moved to :mod:`megapatch.testing.ranks` (it runs :mod:`megapatch.testing.ranks.cpu_launch`)."""

from megapatch.testing.ranks.cpu_launch import main

if __name__ == "__main__":
    main()
