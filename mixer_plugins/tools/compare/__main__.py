"""``python -m mixer_plugins.tools.compare``: the ``compare`` subcommand on its own."""

import sys

from ..cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
