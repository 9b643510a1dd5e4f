"""Source checkouts only: the patch modules live in the top-level ``patches/`` folder (the wheel
ships that folder as ``megapatch/patches``). A ``sys.meta_path`` entry, consulted after the regular
finders, resolves ``megapatch.patches`` there and nothing else."""

import os
import sys

FOLDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")


class SourceCheckoutPatches:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "megapatch.patches":
            return None
        from importlib.util import spec_from_file_location  # (not at start-up: it costs ms)

        return spec_from_file_location(fullname, os.path.join(FOLDER, "__init__.py"),
                                       submodule_search_locations=[FOLDER])


# by name, not isinstance: this module imported again defines a new class
if os.path.isfile(os.path.join(FOLDER, "__init__.py")) and not any(
        type(f).__name__ == SourceCheckoutPatches.__name__ for f in sys.meta_path):
    sys.meta_path.append(SourceCheckoutPatches())
