"""Testing helpers for mixer authors: the conformance kit (see :mod:`.conformance`) and the muP coordinate-check
model over registered mixers (:class:`MixerCoordCheckModel`)."""

from .conformance import CHECKS, CheckResult, ConformanceError, MixerHarness, check_mixer, conformance_test, run_check
from .coord_check import MixerCoordCheckModel

__all__ = ["CHECKS", "CheckResult", "ConformanceError", "MixerHarness", "check_mixer", "conformance_test", "run_check",
           "MixerCoordCheckModel"]
