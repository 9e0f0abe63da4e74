from .tools.cli import main  # noqa: F401  # TRANSITIONAL re-export (lead removes at merge)
