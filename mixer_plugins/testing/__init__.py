"""Testing helpers for mixer authors: the conformance kit (see :mod:`.conformance`)."""

from .conformance import (
    CHECKS,
    CheckResult,
    ConformanceError,
    MixerHarness,
    check_mixer,
    conformance_test,
    run_check,
)

__all__ = ["CHECKS", "CheckResult", "ConformanceError", "MixerHarness", "check_mixer", "conformance_test", "run_check"]
