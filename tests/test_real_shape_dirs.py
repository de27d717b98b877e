"""dspine/bench/real_shapes.py: the dummy-weight serving folders of the published shapes. Each config
is checked against the published numbers (tests/test_real_shapes.py's table), read back with
transformers, the drafter against its target, the DFlash twin against the DSpine drafter; bad
tokenizers are refused before anything is written."""

from __future__ import annotations

import json

import pytest
from test_real_shapes import TARGETS
from transformers import AutoConfig

from dspine.bench import real_shapes
from dspine.model.checkpoint import check_target_compatible
from dspine.model.config import DSpineConfig


@pytest.fixture
def tokenizer_dir(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    vocab = {f"t{i}": i for i in range(300)}
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab},
                                                        "added_tokens": [{"id": 151643, "content": "<|endoftext|>"}]}))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("shape", list(real_shapes.TRAIN_CONFIGS))
def test_folders_hold_the_published_target_and_drafters(shape, tokenizer_dir, tmp_path):
    p = TARGETS[shape]
    root = real_shapes.write_shape(shape, tokenizer_dir, tmp_path / "out")
    target = AutoConfig.from_pretrained(root / "target")
    assert target.architectures == [{"qwen3-8b": "Qwen3ForCausalLM", "qwen3.8-27b": "Qwen3_5ForCausalLM"}[shape]]
    assert (target.hidden_size, target.num_hidden_layers, target.num_attention_heads, target.num_key_value_heads,
            target.head_dim, target.intermediate_size, target.vocab_size) == (
        p.hidden, p.layers, p.heads, p.kv_heads, p.head_dim, p.intermediate, p.vocab)
    if shape == "qwen3.8-27b":
        assert [i for i, t in enumerate(target.layer_types) if t == "full_attention"] == list(range(3, 64, 4))
        # SGLang 0.5.17's Qwen3.5 model reads the interleave as `full_attention_interval`
        assert [i for i in range(64) if (i + 1) % target.full_attention_interval == 0] == list(range(3, 64, 4))
    assert (root / "target" / "tokenizer.json").is_file() and (root / "target" / "tokenizer_config.json").is_file()

    dspine = json.loads((root / "dspine" / "config.json").read_text())
    cfg = DSpineConfig.from_dict(dspine["dspine_config"])
    assert dspine["architectures"] == ["DSpineDraftModel"]
    assert (cfg.num_hidden_layers, cfg.block_size, cfg.sliding_window, cfg.target_layer_ids, cfg.mask_token_id) == (
        p.draft_layers, p.block, p.window, list(p.target_layer_ids), p.mask_token_id)
    check_target_compatible(cfg, target)

    dflash = json.loads((root / "dflash" / "config.json").read_text())
    assert dflash["architectures"] == ["DFlashDraftModel"] and "dspine_config" not in dflash
    assert dflash["dflash_config"] == dspine["dflash_config"]
    same = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "sliding_window", "block_size", "num_target_layers")
    assert {k: dflash[k] for k in same} == {k: dspine[k] for k in same}
    assert not list(root.rglob("*.safetensors"))                       # dummy weights: configs only


def test_a_tokenizer_that_does_not_fit_is_refused_before_writing(tokenizer_dir, tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    (big / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"x": 200000}}}))
    with pytest.raises(real_shapes.ShapeError, match="past the target's vocabulary 151936"):
        real_shapes.write_shape("qwen3-8b", big, tmp_path / "out")
    with pytest.raises(real_shapes.ShapeError, match="no tokenizer.json"):
        real_shapes.write_shape("qwen3-8b", tmp_path, tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()     # nothing half-written
    assert real_shapes.main([str(tokenizer_dir), str(tmp_path / "o"), "--shapes", "llama-70b"]) == 2
