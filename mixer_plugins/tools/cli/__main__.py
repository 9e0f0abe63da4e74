"""``python -m mixer_plugins.tools.cli``: the ``mixer-plugins`` command line."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
