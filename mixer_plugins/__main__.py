"""``python -m mixer_plugins``: the ``mixer-plugins`` command line."""

from mixer_plugins.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
