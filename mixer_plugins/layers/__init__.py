"""Reusable building blocks beneath the mixers: masks, the block's short conv and gated norm, muP and MLBTC.

This layer imports only the kernels and the leaf modules (never the registry or the mixers), so anything here can be
used in a model that does not go through the registry.
"""

from .conv import ShortConv
from .masks import attention_bias_mask, dense_allowed, masked_softmax, padding_mask_to_bool, zero_pads
from .mlbtc import MLBTC, BTCLevel, factorize
from .norm import GatedRMSNorm

__all__ = [
    "BTCLevel",
    "GatedRMSNorm",
    "MLBTC",
    "ShortConv",
    "attention_bias_mask",
    "dense_allowed",
    "factorize",
    "masked_softmax",
    "padding_mask_to_bool",
    "zero_pads",
]
