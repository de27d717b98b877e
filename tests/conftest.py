"""Shared fixtures: tiny random transformers targets and drafters built for them."""

from __future__ import annotations

import pytest
import torch

from dspine import DSpineConfig, DSpineDraftModel

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def tiny_llama(vocab: int = 256, hidden: int = 64, layers: int = 6, seed: int = 0, init: float = 0.2):
    """A random Llama target whose logits are spread enough that greedy near-ties are rare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=init, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def tiny_qwen3(vocab: int = 256, hidden: int = 64, layers: int = 6, seed: int = 1):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def drafter_for(target, seed: int = 0, **overrides) -> DSpineDraftModel:
    """A random DSpine drafter shaped for `target`, attached to it."""
    torch.manual_seed(seed)
    opts = dict(transfer_rank=16, sliding_window=64, injection_top_k=4, selection_top_k=4, successor_table_size=8,
                mask_token_id=3)
    opts.update(overrides)
    cfg = DSpineConfig.for_target(target.config, **opts)
    model = DSpineDraftModel(cfg).eval()
    model.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return model


@pytest.fixture(scope="session")
def llama_target():
    return tiny_llama()


@pytest.fixture(scope="session")
def qwen3_target():
    return tiny_qwen3()


def fixed_prompts(n: int, vocab: int, seed: int = 123) -> list[list[int]]:
    """n prompts of lengths 3..(3+n) with tokens in [4, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (3 + (i * 7) % 23,), generator=g).tolist() for i in range(n)]
