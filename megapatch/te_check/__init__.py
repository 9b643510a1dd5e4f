"""The static Transformer Engine wiring check (``wiring``: ``ast`` over TE's sources, never an
import of TE; its parts ``sources``, ``definitions`` and ``call_sites``) and its verdict cached per
TE installation (``verdict``), for the TE patch's probe."""
