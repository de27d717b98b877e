"""STUB: placeholder for the SGLang draft-model class `DSpineDraftModel` (architecture name in a
DSpine checkpoint's config.json).

Exists only so `ModelRegistry` can resolve the architecture in registration tests; the real class
(a `DFlashDraftModel` subclass with gated adjacent injection and its own `load_weights`) comes
with the worker/model-class task. Constructing it raises.
"""


class DSpineDraftModel:
    """STUB. SGLang builds draft models as `cls(config=hf_config, quant_config=...)`."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(
            "DSpineDraftModel (dspine/sglang/draft_model.py) is a stub: the SGLang draft model class "
            "is not implemented yet, so a DSpine checkpoint cannot be loaded into SGLang in this build.")
