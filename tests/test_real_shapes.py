"""The reference drafter at the published shapes, built on the meta device (no memory).

For our two published targets, Qwen3-8B and the hybrid Qwen3.8-27B, the drafter is built the way
`dspine train` builds it: the packaged training config (`qwen3-8b-dspine`, `qwen3.8-27b-dspine`) and
the target's own transformers model (built on meta from its published config) through
`trainer.build_drafter`. Every expectation below is written from the published numbers in `TARGETS`
alone (an independent formula per tensor, a closed-form parameter count and the exact count it
gives), never read back from the model: the parameter names and shapes (the tensors a saved
checkpoint holds, which `dspine.sglang.draft_weights` maps onto SGLang's draft model: see
tests/sglang/test_real_shapes_sglang.py), the count (the 27B drafter ~2B), the captured target
layers, vocabulary and hidden size equal to the target's, and that nothing was allocated.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dspine.engine.targets import (RANDOM_MASK_TOKENS, RANDOM_SHAPES, load_target_config, random_target_config,
                                   target_identity)
from dspine.model.checkpoint import check_target_compatible, expected_shapes, hf_config
from dspine.model.config import DSpineConfig
from dspine.serve.presets import load_preset
from dspine.train.config import TrainConfig
from dspine.train.trainer import build_drafter


@dataclass(frozen=True)
class Published:
    """A published target (its config.json) and the drafter shape we publish for it."""

    name: str                  # hub id of the target
    preset: str                # serving preset
    train_config: str          # packaged training config of its drafter
    hidden: int
    layers: int                # target decoder layers
    heads: int                 # (full-)attention query heads of the target
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    target_params: tuple[float, float]   # plausible range of the target's own parameter count
    # the drafter
    window: int                # dspine_config.sliding_window
    target_layer_ids: tuple[int, ...]
    drafter_params: int        # exact count of the formula in `parameter_count`
    mask_token_id: int         # no shape depends on it; any unused id below the vocabulary
    draft_layers: int = 5
    block: int = 16
    rank: int = 256            # transfer_rank
    top_k: int = 8             # injection_top_k and selection_top_k


TARGETS = {
    # Qwen/Qwen3-8B config.json; mask: `<|vision_pad|>`, as `mask_token_candidate` picks for Qwen3.
    "qwen3-8b": Published(
        name="Qwen/Qwen3-8B", preset="qwen3-8b", train_config="qwen3-8b-dspine", hidden=4096, layers=36, heads=32,
        kv_heads=8, head_dim=128, intermediate=12288, vocab=151936, rope_theta=1e6, target_params=(8.0e9, 8.4e9),
        window=2048, target_layer_ids=(1, 9, 17, 25, 33), drafter_params=1_149_383_937, mask_token_id=151654),
    # Qwen/Qwen3.8-27B text config (Qwen3.5 layout): 64 layers = 16 x (3 Gated-DeltaNet + 1 gated full
    # attention of 24 heads / 4 KV heads / head_dim 256), MLP 17408, vocab 248320 (padded), rope theta 1e7.
    "qwen3.8-27b": Published(
        name="Qwen/Qwen3.8-27B", preset="qwen3.8-27b", train_config="qwen3.8-27b-dspine", hidden=5120, layers=64,
        heads=24, kv_heads=4, head_dim=256, intermediate=17408, vocab=248320, rope_theta=1e7,
        target_params=(26.0e9, 28.0e9), window=8192, target_layer_ids=(1, 16, 31, 46, 61),
        drafter_params=1_987_216_897, mask_token_id=248070),
}
QWEN38_27B_TEXT = RANDOM_SHAPES["qwen3.8-27b"]   # the text_config block of its config.json (shape keys)


# ------------------------------------------------------------------ independent expectations
def checkpoint_shapes(p: Published) -> dict[str, tuple[int, ...]]:
    """Every tensor of the drafter's checkpoint, from the published numbers alone: DFlash's layout
    (`fc` over K = 5 captured layers, Qwen3 layers with q/k norms) plus DSpine's mask embedding,
    transfer projection P, one gated injection per layer, W_T and the confidence head."""
    h, q, kv, r = p.hidden, p.heads * p.head_dim, p.kv_heads * p.head_dim, p.rank
    shapes = {"fc.weight": (h, len(p.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "mask_embedding": (h,), "transfer.proj.weight": (r, h), "transition.weight": (r, r),
              "confidence.weight": (1, h), "confidence.bias": (1,)}
    for i in range(p.draft_layers):
        layer = f"layers.{i}"
        shapes.update({
            f"{layer}.input_layernorm.weight": (h,), f"{layer}.post_attention_layernorm.weight": (h,),
            f"{layer}.self_attn.q_proj.weight": (q, h), f"{layer}.self_attn.k_proj.weight": (kv, h),
            f"{layer}.self_attn.v_proj.weight": (kv, h), f"{layer}.self_attn.o_proj.weight": (h, q),
            f"{layer}.self_attn.q_norm.weight": (p.head_dim,), f"{layer}.self_attn.k_norm.weight": (p.head_dim,),
            f"{layer}.mlp.gate_proj.weight": (p.intermediate, h), f"{layer}.mlp.up_proj.weight": (p.intermediate, h),
            f"{layer}.mlp.down_proj.weight": (h, p.intermediate),
            f"injections.{i}.score_proj.weight": (r, h), f"injections.{i}.gate.weight": (h, h + r),
            f"injections.{i}.gate.bias": (h,), f"injections.{i}.out_proj.weight": (h, r),
        })
    return shapes


def parameter_count(p: Published) -> int:
    """Closed form, by component (no vocabulary-sized tensor: embeddings and lm_head are the target's)."""
    h, q, kv, r, i = p.hidden, p.heads * p.head_dim, p.kv_heads * p.head_dim, p.rank, p.intermediate
    attention = 2 * h * q + 2 * h * kv + 2 * p.head_dim
    layer = attention + 3 * h * i + 2 * h
    injection = r * h + (h + r) * h + h + h * r
    return (p.draft_layers * (layer + injection) + len(p.target_layer_ids) * h * h + 3 * h + r * h + r * r + h + 1)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ----------------------------------------------------------------------------------- building
def hub_config(p: Published):
    """The target's config as its hub config.json parses: Qwen3-8B from the repo's own table of known
    shapes (`random:qwen3-8b`), Qwen3.8-27B as the composite Qwen3_5Config (text + vision)."""
    if p.preset == "qwen3-8b":
        return random_target_config("random:qwen3-8b")
    text = dict(QWEN38_27B_TEXT)
    text.pop("model_type")
    return AutoConfig.for_model("qwen3_5", text_config=text, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=list(TARGETS))
def built(request):
    """(published numbers, target model on meta, drafter on meta as `dspine train` builds it, peak RSS
    growth in bytes while building the drafter)."""
    p = TARGETS[request.param]
    with torch.device("meta"):  # AutoModelForCausalLM: the model class `dspine train` loads
        target = AutoModelForCausalLM.from_config(hub_config(p))
    cfg = TrainConfig.from_yaml(p.train_config)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    drafter, _ = build_drafter(cfg, target, p.mask_token_id, "meta")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return p, target, drafter, grown, cfg


# -------------------------------------------------------------------------------------- tests
def test_the_published_targets_are_what_the_training_config_names(built):
    p, target, _, _, cfg = built
    tc = target.config
    assert cfg.target == p.name
    assert (tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim,
            tc.intermediate_size, tc.vocab_size, tc.tie_word_embeddings) == (
        p.hidden, p.layers, p.heads, p.kv_heads, p.head_dim, p.intermediate, p.vocab, False)
    theta = getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"]
    assert theta == p.rope_theta
    assert len(target.model.layers) == p.layers
    emb, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    assert tuple(emb.shape) == tuple(head.shape) == (p.vocab, p.hidden) and emb is not head  # untied
    assert p.target_params[0] < sum(t.numel() for t in target.parameters()) < p.target_params[1]
    if p.preset == "qwen3.8-27b":  # hybrid: every 4th layer full attention, the rest Gated DeltaNet
        assert type(target).__name__ == "Qwen3_5ForCausalLM"
        assert [i for i, t in enumerate(tc.layer_types) if t == "full_attention"] == list(range(3, 64, 4))


def test_the_drafter_config_follows_the_target_and_the_published_drafter(built):
    p, target, drafter, _, _ = built
    dc = drafter.config
    assert (dc.hidden_size, dc.vocab_size, dc.num_target_layers) == (p.hidden, p.vocab, p.layers)
    assert (dc.num_attention_heads, dc.num_key_value_heads, dc.head_dim, dc.intermediate_size) == (
        p.heads, p.kv_heads, p.head_dim, p.intermediate)
    assert (dc.num_hidden_layers, dc.block_size, dc.sliding_window, dc.transfer_rank) == (
        p.draft_layers, p.block, p.window, p.rank)
    assert (dc.injection, dc.injection_top_k, dc.selection, dc.selection_top_k, dc.confidence_head) == (
        True, p.top_k, "transition", p.top_k, True)
    assert dc.rope_theta == p.rope_theta and dc.mask_token_id == p.mask_token_id < p.vocab
    check_target_compatible(dc, target.config)  # what loading against the target checks


def test_captured_target_layers(built):
    """Five captured layers (one per draft layer), evenly spaced from layer 1 to the fourth-last."""
    p, _, drafter, _, _ = built
    ids = drafter.config.target_layer_ids
    assert ids == list(p.target_layer_ids) and drafter.config.num_context_features == len(ids) == p.draft_layers
    assert ids[0] == 1 and ids[-1] == p.layers - 3 and all(0 <= i < p.layers for i in ids)
    gaps = [b - a for a, b in zip(ids, ids[1:])]
    assert max(gaps) - min(gaps) <= 1 and sum(gaps) == p.layers - 4
    assert tuple(drafter.fc.weight.shape) == (p.hidden, len(ids) * p.hidden)


def test_parameter_names_and_shapes(built):
    """The drafter's state dict (what `save_checkpoint` writes) is exactly the independent layout, and
    it is what `check_weights` demands of a saved checkpoint (`expected_shapes`)."""
    p, _, drafter, _, _ = built
    want = checkpoint_shapes(p)
    got = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    assert got == want
    assert {n for n, _ in drafter.named_parameters()} == set(want) and not list(drafter.named_buffers())
    assert expected_shapes(drafter.config) == want


def test_parameter_count(built):
    p, _, drafter, _, _ = built
    count = sum(t.numel() for t in drafter.parameters())
    assert count == parameter_count(p) == sum(numel(s) for s in checkpoint_shapes(p).values()) == p.drafter_params
    if p.preset == "qwen3.8-27b":
        assert 1.5e9 <= count <= 2.5e9


def test_building_allocates_nothing(built):
    """Every tensor on meta; building the drafter (>= 2.2 GB of bf16 weights at 8B) grew the process's
    peak memory by far less than one weight matrix; the target's head attaches by reference."""
    p, target, drafter, grown, _ = built
    assert all(t.is_meta for t in drafter.parameters()) and all(t.is_meta for t in target.parameters())
    assert grown < 64 << 20, f"peak RSS grew by {grown >> 20} MiB while building the drafter"
    assert drafter.target_tensor("output_embeddings").is_meta
    assert tuple(drafter.target_tensor("input_embeddings").shape) == (p.vocab, p.hidden)
    with pytest.raises(ValueError, match="trained for another target"):
        drafter.attach_target(torch.empty(p.vocab - 1, p.hidden, device="meta"),
                              torch.empty(p.vocab, p.hidden, device="meta"))


def test_the_checkpoint_config_mirrors_the_shapes_sglang_reads(built):
    """config.json of a saved drafter: Qwen3-style top-level shape keys, the `dflash_config` mirror
    SGLang sizes `fc` and captures target layers from, and `dspine_config` round-tripping."""
    p, _, drafter, _, _ = built
    data = hf_config(drafter.config, "bfloat16")
    assert data["architectures"] == ["DSpineDraftModel"] and data["model_type"] == "qwen3"
    assert {k: data[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "head_dim", "vocab_size", "rope_theta", "sliding_window",
                                 "block_size", "num_target_layers", "tie_word_embeddings")} == dict(
        hidden_size=p.hidden, intermediate_size=p.intermediate, num_hidden_layers=p.draft_layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, head_dim=p.head_dim, vocab_size=p.vocab,
        rope_theta=p.rope_theta, sliding_window=p.window, block_size=p.block, num_target_layers=p.layers,
        tie_word_embeddings=False)
    assert data["layer_types"] == ["full_attention"] * p.draft_layers
    assert data["dflash_config"] == {"block_size": p.block, "target_layer_ids": list(p.target_layer_ids),
                                     "num_target_layers": p.layers, "mask_token_id": p.mask_token_id}
    assert DSpineConfig.from_dict(data["dspine_config"]) == drafter.config


def test_the_serving_preset_matches_the_drafter(built):
    """The preset's verify width is the block; where it sets a draft window, it is the trained one."""
    p, _, drafter, _, _ = built
    preset = load_preset(p.preset)
    assert preset.model == p.name
    assert preset.flags["--speculative-num-draft-tokens"] == [str(drafter.config.block_size)]
    window = preset.flags.get("--speculative-draft-window-size")
    assert window is None or window == [str(drafter.config.sliding_window)]
    if p.preset == "qwen3.8-27b":
        assert window == ["8192"]


def test_a_27b_drafter_trained_by_dspine_train_is_accepted_by_its_target(tmp_path):
    p = TARGETS["qwen3.8-27b"]
    composite = hub_config(p)
    composite.save_pretrained(tmp_path)  # the target's config.json, as `dspine train --target DIR` reads it
    stamped = target_identity(load_target_config(str(tmp_path)), p.name)  # trainer.train -> save_checkpoint
    cfg = TrainConfig.from_yaml(p.train_config)
    dc = DSpineConfig.for_target(composite.get_text_config(), mask_token_id=p.mask_token_id, **cfg.drafter)
    # dspine_worker_v2: check_target_compatible(cfg, hf_config.get_text_config(), saved_target=dspine_target);
    # load_checkpoint(target=model) does the same with model.config, the text config.
    check_target_compatible(dc, composite.get_text_config(), saved_target=stamped)
    # and the combined config itself reads as its text part everywhere
    assert target_identity(composite)["fingerprint"] == stamped["fingerprint"] == \
        target_identity(composite.get_text_config())["fingerprint"]
    assert DSpineConfig.for_target(composite, mask_token_id=p.mask_token_id, **cfg.drafter) == dc
