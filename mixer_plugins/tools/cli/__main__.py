"""``python -m mixer_plugins.tools.cli``: the ``mixer-plugins`` command line."""

import sys

from .main import main

sys.exit(main())
