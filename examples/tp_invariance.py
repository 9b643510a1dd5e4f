"""The main job, as a script: how far the tiny GPT's logits drift when only the TP size changes,
native vs fp32-accumulate vs fp32 TP reductions. Same as `megapatch demo`.

    python examples/tp_invariance.py            # TP 1,2,4,8; writes tp_invariance.png
"""

import sys

from megapatch.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
