"""Drop-ins for people leaving other codebases: modules with their constructor arguments and ``state_dict`` keys,
backed by our mixers, and converters for their checkpoints.

* :class:`Hydra` (:mod:`.hydra`): the released Hydra module (``goombalab/hydra``, ``hydra/modules/hydra.py``);
  its checkpoints load unchanged.
* :class:`Mamba2` (:mod:`.mamba2`): the released Mamba-2 module (``state-spaces/mamba``,
  ``mamba_ssm/modules/mamba2.py``), with its inference API (``allocate_inference_cache``, ``step``); its checkpoints
  load unchanged.
* :func:`convert_matrix_mixer_state_dict`: a released ``MatrixMixer`` checkpoint (``hydra/modules/matrix_mixer.py``),
  of any type, in our mixers' layout; :func:`matrix_mixer_options` names the mixer and options to load it into.
* :func:`convert_structured_attention_state_dict` (:mod:`.structured_attention`): a released structured-attention
  module's checkpoint (MHA, SWA, GSWA, MLR, Bilinear-MLR, Bilinear-BTT of the paper's ``src/model.py``) in ours.

This package sits above :mod:`mixer_plugins.mixers` (it imports concrete mixers) and beside
:mod:`mixer_plugins.testing`.
"""

from .hydra import Hydra, convert_matrix_mixer_state_dict, matrix_mixer_options
from .mamba2 import Mamba2
from .structured_attention import RELEASED_ATTENTION_KINDS, convert_structured_attention_state_dict

__all__ = ["Hydra", "Mamba2", "RELEASED_ATTENTION_KINDS", "convert_matrix_mixer_state_dict",
           "convert_structured_attention_state_dict", "matrix_mixer_options"]
