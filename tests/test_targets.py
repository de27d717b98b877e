"""Target loading: SmolLM2 from the bundled GGUF (converted once, cached), chat prompts, special
tokens, atomic conversion and helpful errors. One loaded SmolLM2 is shared by the module."""

from __future__ import annotations

import time

import pytest
import torch

from dspine.engine import targets
from dspine.engine.targets import (
    DEFAULT_TARGET,
    TargetLoadError,
    chat_prompt_ids,
    load_target,
    mask_token_candidate,
    stop_token_ids,
)


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return load_target()


def test_smollm2_config(smollm2):
    model, _ = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (9, 3, 1536)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_model_frozen_eval_fp32(smollm2):
    model, _ = smollm2
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_cached_dir_is_reused(smollm2, monkeypatch):
    """Second load reads the cached directory; it never converts again."""
    path = targets.smollm2_dir()
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()
    }

    def no_conversion(target):
        raise AssertionError("converted twice")

    monkeypatch.setattr(targets, "_convert_smollm2", no_conversion)
    start = time.perf_counter()
    model, tokenizer = load_target(DEFAULT_TARGET)
    assert time.perf_counter() - start < 20
    assert tokenizer.chat_template == smollm2[1].chat_template
    # The same directory also loads as a plain local-directory spec.
    model2, _ = load_target(str(path))
    assert torch.equal(model2.model.embed_tokens.weight, smollm2[0].model.embed_tokens.weight)


def test_chat_prompt_ids(smollm2):
    _, tokenizer = smollm2
    ids = chat_prompt_ids(tokenizer, "What is the capital of France?")
    assert ids == chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")  # SmolLM2's template adds a default system turn
    assert text.endswith("What is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_greedy_answer_is_plausible(smollm2):
    model, tokenizer = smollm2
    ids = torch.tensor([chat_prompt_ids(tokenizer, "What is the capital of France?")])
    with torch.no_grad():
        first = model(ids).logits[0, -1].argmax().item()
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode([first]) == "The"
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])


def test_special_tokens(smollm2):
    model, tokenizer = smollm2
    stops = stop_token_ids(tokenizer, model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stops[0] == im_end == 2
    assert stops == [2, 0]  # <|im_end|>, <|endoftext|>
    mask = mask_token_candidate(tokenizer)
    assert mask == 16 and tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    assert mask < model.config.vocab_size
    assert mask not in stops + [tokenizer.bos_token_id, tokenizer.pad_token_id]
    assert tokenizer.convert_ids_to_tokens(mask) not in tokenizer.chat_template


def test_conversion_is_atomic(tmp_path, monkeypatch):
    """A failure after some files are written leaves neither the target dir nor a temp dir."""
    monkeypatch.setenv("DSPINE_CACHE", str(tmp_path))
    seen: list[str] = []

    def fail_midway(gguf, config, out):
        seen.extend(p.name for p in out.iterdir())
        raise RuntimeError("simulated failure while writing weights")

    monkeypatch.setattr(targets, "_save_weights", fail_midway)
    with pytest.raises(RuntimeError, match="simulated failure"):
        load_target()
    assert "tokenizer.json" in seen  # the failure really happened mid-way
    assert list((tmp_path / "targets").iterdir()) == []


def test_bogus_hub_id_raises_helpful_error():
    with pytest.raises(TargetLoadError) as err:
        load_target("no-such-org/no-such-model-dspine")
    msg = str(err.value)
    assert "no-such-org/no-such-model-dspine" in msg
    assert "local" in msg and DEFAULT_TARGET in msg


@pytest.mark.parametrize("bad", ["/no/such/dir", "./missing-model"])
def test_missing_path_raises_helpful_error(bad):
    with pytest.raises(TargetLoadError, match="not a directory"):
        load_target(bad)


def test_directory_without_model_raises(tmp_path):
    with pytest.raises(TargetLoadError, match="config.json"):
        load_target(str(tmp_path))
