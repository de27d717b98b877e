"""Checkpoint format: exact round trip, sharding, strict validation with named errors, atomic save."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import drafter_for, tiny_llama
from dspine.model.checkpoint import (CheckpointError, IncompatibleTargetError, MissingTensorsError, TensorMismatchError,
                               UnexpectedTensorsError, load_checkpoint, save_checkpoint)


@pytest.fixture()
def saved(tmp_path, llama_target):
    model = drafter_for(llama_target)
    return model, save_checkpoint(model, tmp_path / "ckpt", dtype=torch.float32)


def test_round_trip_is_exact(saved, llama_target):
    model, path = saved
    loaded = load_checkpoint(path, target=llama_target)
    assert loaded.config == model.config
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DSpineDraftModel"] and cfg["model_type"] == "qwen3"


def test_sharded_round_trip(tmp_path, llama_target):
    model = drafter_for(llama_target)
    path = save_checkpoint(model, tmp_path / "sharded", dtype=torch.bfloat16, max_shard_bytes=60_000)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    loaded = load_checkpoint(path, dtype=torch.bfloat16)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16)), name


def test_hf_config_parses_with_transformers(saved):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(saved[1])
    assert cfg.architectures == ["DSpineDraftModel"] and cfg.num_hidden_layers == 5


def _edit_tensors(path, fn):
    f = path / "model.safetensors"
    state = load_file(str(f))
    fn(state)
    save_file(state, str(f), metadata={"format": "pt"})


def test_missing_tensor(saved):
    _, path = saved
    _edit_tensors(path, lambda s: s.pop("fc.weight"))
    with pytest.raises(MissingTensorsError, match="fc.weight"):
        load_checkpoint(path)


def test_unexpected_tensor(saved):
    _, path = saved
    _edit_tensors(path, lambda s: s.__setitem__("extra.weight", torch.zeros(2)))
    with pytest.raises(UnexpectedTensorsError, match="extra.weight"):
        load_checkpoint(path)


def test_wrong_shape_and_dtype(saved):
    _, path = saved
    original = load_file(str(path / "model.safetensors"))["fc.weight"]
    _edit_tensors(path, lambda s: s.__setitem__("fc.weight", torch.zeros(3, 3)))
    with pytest.raises(TensorMismatchError, match=r"fc.weight has shape \(3, 3\)"):
        load_checkpoint(path)
    _edit_tensors(path, lambda s: s.__setitem__("fc.weight", original.half()))
    with pytest.raises(TensorMismatchError, match="config.json dtype says"):
        load_checkpoint(path)


@pytest.mark.parametrize("field,target_kwargs", [("vocab_size", dict(vocab=300)), ("hidden_size", dict(hidden=32)),
                                                 ("num_target_layers", dict(layers=4))])
def test_incompatible_target_names_the_field(saved, field, target_kwargs):
    other = tiny_llama(**target_kwargs)
    with pytest.raises(IncompatibleTargetError, match=f"dspine_config.{field}"):
        load_checkpoint(saved[1], target=other)


def test_mask_id_and_layer_ids_checked(tmp_path, llama_target):
    path = save_checkpoint(drafter_for(llama_target), tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["dspine_config"]["target_layer_ids"] = [1, 9]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        load_checkpoint(path)
    cfg["dspine_config"]["target_layer_ids"] = [1, 3, 4]
    cfg["dspine_config"]["mask_token_id"] = 999
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_checkpoint(path)


def test_bad_config_and_bad_paths(saved, tmp_path):
    _, path = saved
    with pytest.raises(CheckpointError, match="neither a local directory"):
        load_checkpoint(tmp_path / "does-not-exist")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="not a DSpine drafter"):
        load_checkpoint(path)
    (path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)


def test_failed_save_leaves_nothing(tmp_path, llama_target, monkeypatch):
    model = drafter_for(llama_target)
    good = save_checkpoint(model, tmp_path / "ckpt")
    before = sorted(p.name for p in good.iterdir())

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("dspine.model.checkpoint.save_torch_state_dict", boom)
    with pytest.raises(OSError):
        save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(OSError):
        save_checkpoint(model, tmp_path / "fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]          # no temp dirs, no partial "fresh"
    assert sorted(p.name for p in good.iterdir()) == before                 # the old checkpoint is intact
    load_checkpoint(good)


def test_config_json_carries_the_keys_transformers_and_sglang_read(saved):
    model, path = saved
    cfg = json.loads((path / "config.json").read_text())
    dc = model.config
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32" and cfg["num_target_layers"] == dc.num_target_layers
    assert cfg["layer_types"] == ["full_attention"] * dc.num_hidden_layers   # no per-layer window
    assert cfg["sliding_window"] == dc.sliding_window and cfg["use_sliding_window"] is False
    assert cfg["is_causal"] is False                    # the block attends bidirectionally
    from transformers import AutoConfig

    parsed = AutoConfig.from_pretrained(path)
    assert parsed.layer_types == cfg["layer_types"]


def test_checkpoint_without_the_new_keys_still_loads(saved):
    model, path = saved
    cfg = json.loads((path / "config.json").read_text())
    for key in ("dtype", "num_target_layers", "layer_types", "sliding_window", "use_sliding_window", "is_causal"):
        cfg.pop(key)
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = load_checkpoint(path)
    assert all(torch.equal(loaded.state_dict()[k], t) for k, t in model.state_dict().items())


def test_default_shards_are_5gb_through_huggingface_hub(tmp_path, llama_target, monkeypatch):
    import huggingface_hub

    seen = {}
    real = huggingface_hub.save_torch_state_dict
    monkeypatch.setattr("dspine.model.checkpoint.save_torch_state_dict",
                        lambda state, where, **kw: seen.update(kw) or real(state, where, **kw))
    path = save_checkpoint(drafter_for(llama_target), tmp_path / "c")
    assert seen == {"max_shard_size": "5GB"} and (path / "model.safetensors").is_file()
    assert not (path / "model.safetensors.index.json").exists()


def test_target_fingerprint_is_recorded_and_checked(tmp_path, llama_target):
    from dspine.engine.targets import target_identity

    identity = target_identity(llama_target.config, "tiny/llama")
    path = save_checkpoint(drafter_for(llama_target), tmp_path / "c", target=identity)
    assert json.loads((path / "config.json").read_text())["dspine_target"] == identity
    load_checkpoint(path, target=llama_target)                      # same target: loads
    other = tiny_llama()
    other.config.num_attention_heads = other.config.num_attention_heads * 2   # same shapes the checks read
    with pytest.raises(IncompatibleTargetError, match="fingerprint.*dspine train --target"):
        load_checkpoint(path, target=other)


def test_model_card_has_hub_front_matter_and_the_training_record(tmp_path, llama_target):
    from dspine.engine.targets import target_identity

    path = save_checkpoint(drafter_for(llama_target), tmp_path / "card",
                           target=target_identity(llama_target.config, "owner/tiny-llama"),
                           card={"data_hash": "sha256:abc123", "code_version": "0.3.0+g1234567",
                                 "budget": {"steps": 10, "batch_size": 2}})
    text = (path / "README.md").read_text()
    front = text.split("---\n")[1]
    assert front.splitlines() == ["base_model: owner/tiny-llama", "license: apache-2.0", "library_name: dspine",
                                  "tags:", "- speculative-decoding", "- dspine", "- draft-model"]
    assert "Data hash: sha256:abc123" in text and "Code version: 0.3.0+g1234567" in text
    assert "Budget: steps 10, batch_size 2" in text and str(tmp_path) not in text
    local = save_checkpoint(drafter_for(llama_target), tmp_path / "local",
                            target=target_identity(llama_target.config, str(tmp_path / "target")))
    assert "base_model" not in (local / "README.md").read_text()      # a local path is no hub id
    with pytest.raises(ValueError, match="unknown"):
        save_checkpoint(drafter_for(llama_target), tmp_path / "bad", card={"data": "/tmp/x.jsonl"})


def test_a_truncated_or_padded_file_names_itself_and_the_fix(saved):
    from dspine.model.checkpoint import CorruptWeightsError, check_weights, read_config

    _, path = saved
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    for broken in (data[: len(data) // 2], data + b"\0" * 16):
        weights.write_bytes(broken)
        with pytest.raises(CorruptWeightsError, match=f"{weights}: not a readable safetensors file.*re-download"):
            load_checkpoint(path)
        with pytest.raises(CorruptWeightsError, match="truncated or corrupt"):
            check_weights(path, read_config(path))


def test_a_missing_shard_or_a_tensor_the_index_misplaces_is_named(tmp_path, llama_target):
    from dspine.model.checkpoint import CorruptWeightsError

    path = save_checkpoint(drafter_for(llama_target), tmp_path / "sharded", max_shard_bytes=60_000)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_file.write_text(json.dumps(index))
    with pytest.raises(CorruptWeightsError, match=f"puts tensor {name} in .*{shards[1]}, which does not hold it"):
        load_checkpoint(path)
    (path / shards[1]).unlink()
    with pytest.raises(CorruptWeightsError, match=f"{shards[1]}'\\] listed in .*index.json are missing.*re-download"):
        load_checkpoint(path)
    index_file.write_text("{}")
    with pytest.raises(CorruptWeightsError, match="no readable `weight_map`"):
        load_checkpoint(path)
