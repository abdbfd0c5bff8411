"""Block formats: dequantize and quantize GGUF tensor bytes in vectorized numpy.

INTERIM: delegates to gguf.quants until the vectorized implementation lands (issue 2).
"""

from __future__ import annotations

import numpy as np
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    out = gguf_quants.dequantize(np.asarray(raw, dtype=np.uint8), GGMLQuantizationType[type_name])
    return out.reshape(shape).astype(np.float32, copy=False)
