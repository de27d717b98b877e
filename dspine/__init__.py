"""DSpine: a five-layer parallel drafter for lossless speculative decoding, as an SGLang plugin.

Engine-independent API (no SGLang import): the drafter, its checkpoint format, selection and
acceptance, and the reference engine `generate`.
"""

from dspine.model.config import ConfigError, DSpineConfig
from dspine.model.drafter import DSpineDrafter
from dspine.engine.generate import GenerationResult, GenerationStats, generate

__all__ = ["ConfigError", "DSpineConfig", "DSpineDraftModel", "GenerationResult", "GenerationStats", "generate"]
__version__ = "0.1.0"
