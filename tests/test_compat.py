"""The SGLang version shims that need no SGLang: each against a stand-in of the module it patches."""

import types

from dspine.sglang import compat


class _Body:
    def __init__(self):
        self.captured = None

    def set_dflash_layers_to_capture(self, layer_ids):
        self.captured = list(layer_ids)


def _text_module(with_seam: bool):
    class Qwen3_5ForCausalLM:
        def __init__(self):
            self.model = _Body()
            self.capture_aux_hidden_states = False

    if with_seam:
        Qwen3_5ForCausalLM.set_dflash_layers_to_capture = lambda self, ids: ("own", ids)

    class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
        pass

    return types.SimpleNamespace(Qwen3_5ForCausalLM=Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM=Qwen3_5MoeForCausalLM)


def test_text_qwen3_5_capture_added_where_missing():
    module = _text_module(with_seam=False)
    compat.add_text_qwen3_5_capture(module)
    for cls in (module.Qwen3_5ForCausalLM, module.Qwen3_5MoeForCausalLM):
        model = cls()
        model.set_dflash_layers_to_capture([1, 9, 17])
        assert model.capture_aux_hidden_states is True
        assert model.model.captured == [2, 10, 18]      # target layer i = input of body layer i + 1


def test_text_qwen3_5_capture_left_alone_where_defined():
    module = _text_module(with_seam=True)
    compat.add_text_qwen3_5_capture(module)
    model = module.Qwen3_5ForCausalLM()
    assert model.set_dflash_layers_to_capture([3]) == ("own", [3])
    assert model.model.captured is None


def test_text_qwen3_5_capture_tolerates_a_module_without_the_class():
    compat.add_text_qwen3_5_capture(types.SimpleNamespace())
