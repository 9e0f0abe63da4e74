"""Adapters that put any registered mixer into host libraries' backbones.

* :mod:`mixer_plugins.backbones.timm` — timm Vision Transformers (imported once timm is, after or before
  ``import mixer_plugins``, whose post-import hook imports it; it registers our timm model names).
* :mod:`mixer_plugins.backbones.fairseq2` — fairseq2 encoders, decoders and NLLB; loaded by fairseq2 itself through our
  ``fairseq2.extension`` entry point, never by ``import mixer_plugins``.
* :mod:`mixer_plugins.backbones.options` — the one resolver that fills a mixer's options from the host model
  (width, heads, length, direction, biases), shared by both adapters and the tools.
* :mod:`mixer_plugins.backbones.reinit` — re-drawing a mixer's own initialisation when a host re-initialises.

Importing this package imports neither timm nor fairseq2.
"""
