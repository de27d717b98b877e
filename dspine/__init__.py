"""DSpine: a five-layer parallel drafter for lossless speculative decoding, as an SGLang plugin.

Engine-independent API (no SGLang import): the drafter, its config, and the reference engine
`generate`. Names resolve on first use, so `import dspine` (and `dspine --help`) loads no torch.
"""

import importlib

_EXPORTS = {
    "ConfigError": "dspine.model.config",
    "DSpineConfig": "dspine.model.config",
    "DSpineDrafter": "dspine.model.drafter",
    "GenerationResult": "dspine.engine.generate",
    "GenerationStats": "dspine.engine.generate",
    "generate": "dspine.engine.generate",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dspine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
