"""Adapters that put any registered mixer into host libraries' backbones.

* :mod:`mixer_plugins.backbones.timm` — timm Vision Transformers (imported by ``import mixer_plugins``,
  which registers our timm model names).
* :mod:`mixer_plugins.backbones.fairseq2` — fairseq2 encoders; loaded by fairseq2 itself through our
  ``fairseq2.extension`` entry point, never by ``import mixer_plugins``.
"""
