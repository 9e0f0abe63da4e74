"""Drop-ins for people leaving other codebases: modules with their constructor arguments and ``state_dict`` keys,
backed by our mixers, and converters for their checkpoints.

* :class:`Hydra` (:mod:`.hydra`): the released Hydra module (``goombalab/hydra``, ``hydra/modules/hydra.py``);
  its checkpoints load unchanged.
* :func:`convert_matrix_mixer_state_dict`: a released ``MatrixMixer`` checkpoint (``hydra/modules/matrix_mixer.py``)
  in our mixers' layout.

This package sits above :mod:`mixer_plugins.mixers` (it imports concrete mixers) and beside
:mod:`mixer_plugins.testing`.
"""

from .hydra import Hydra, convert_matrix_mixer_state_dict

__all__ = ["Hydra", "convert_matrix_mixer_state_dict"]
