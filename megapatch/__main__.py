import sys

from megapatch.commands.cli import main

sys.exit(main())
