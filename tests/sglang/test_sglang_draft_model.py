"""DSpine's SGLang draft model and worker seams on CPU, against the real SGLang classes.

What runs here, per installed SGLang (0.5.17 and 0.5.22 venvs):
- registry resolution after `load_plugins()`;
- SGLang's own model classes built on CPU: a single-process gloo group and SGLang's model-parallel
  state (as SGLang's layer unit tests do), server args published through SGLang's own parser.
  One CPU stand-in: `RotaryEmbedding.__init__` asks for a CUDA/vLLM kernel unless SGLang's CPU
  engine flag is set, so its module-level `_is_cpu` is patched to True while the model is built
  (the native rotary path then runs, as on any non-CUDA device);
- `load_weights`: the name mapping, q/k/v and gate/up stacking, strict coverage errors;
- the draft forward end to end (mask embedding, layers, adjacent injection on the padded
  `view(-1, N, H)` layout, final norm) against DSpine's reference drafter, with RadixAttention
  replaced by a plain attention over the context K/V that SGLang's model methods materialise
  (`project_target_hidden`, `kv_proj_only`, `apply_k_norm`, `apply_k_rope`, as the worker does);
- token choice: the in-graph sampler (0.5.17), the eager fallback and the selector seam (0.5.20+;
  on 0.5.22 through SGLang's own `_SelectorDraftSampler`) against `dspine.model.selection.select_tokens`;
- the worker's target attach, transfer-table refresh and ReplaySSM commit routing on bare
  instances (a real `DFlashWorkerV2.__init__` needs a GPU).
"""

from __future__ import annotations

import importlib.metadata
import json
from types import SimpleNamespace

import pytest

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch import nn  # noqa: E402

from dspine import DSpineConfig  # noqa: E402
from dspine.model import drafter as ref_drafter  # noqa: E402
from dspine.model.checkpoint import (  # noqa: E402
    MissingTensorsError,
    TensorMismatchError,
    UnexpectedTensorsError,
    load_checkpoint,
    save_checkpoint,
)
from dspine.model.config import ConfigError  # noqa: E402
from dspine.kernels.adjacent_injection import adjacent_injection_reference  # noqa: E402
from dspine.kernels.transition_select import transition_path_reference  # noqa: E402
from dspine.model.selection import select_tokens  # noqa: E402
from sglang_cpu import publish_args, single_process_groups  # noqa: E402

V, H, N, R, K, TARGET_LAYERS = 256, 64, 8, 16, 4, 6
TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": TARGET_LAYERS,
          "vocab_size": V, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "torch_dtype": "float32", "tie_word_embeddings": False}


def dspine_cfg(**overrides) -> DSpineConfig:
    opts = dict(hidden_size=H, vocab_size=V, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                num_target_layers=TARGET_LAYERS, mask_token_id=3, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                block_size=N, transfer_rank=R, sliding_window=64, injection_top_k=K, selection_top_k=K,
                successor_table_size=8, transition_lambda=1.0, injection_candidates="per_layer")
    opts.update(overrides)
    return DSpineConfig(**opts)


def random_drafter(cfg: DSpineConfig, seed: int = 0) -> ref_drafter.DSpineDrafter:
    """A reference drafter with every weight random (norms near 1), so no part of the math is trivial."""
    torch.manual_seed(seed)
    model = ref_drafter.DSpineDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name == "transition.weight":
                p.normal_(0, 2.0)
            elif name == "mask_embedding" or name.endswith(".bias"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    return model.eval()


def write_checkpoint(path, cfg: DSpineConfig, seed: int = 0, mirror: bool = True):
    save_checkpoint(random_drafter(cfg, seed), path, dtype=torch.float32)
    if not mirror:  # a checkpoint written before the mirror existed
        config_file = path / "config.json"
        config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                           if k != "dflash_config"}))
    return str(path)


def read_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dspine_ckpt") / "draft", dspine_cfg())


@pytest.fixture(scope="module")
def sglang_env(ckpt, tmp_path_factory):
    """Plugins loaded, server args parsed and published by SGLang, a world-1 gloo group with SGLang's
    model-parallel state, and the rotary CPU stand-in (see the module docstring)."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    target = tmp_path_factory.mktemp("target")
    (target / "config.json").write_text(json.dumps(TARGET))
    server_args = prepare_server_args(["--model-path", str(target), "--speculative-algorithm", "dspine",
                                       "--speculative-draft-model-path", ckpt, "--device", "cpu",
                                       "--skip-tokenizer-init"])
    if hasattr(server_args, "resolve_once"):  # >= 0.5.20
        server_args.resolve_once()
    publish_args(server_args)
    with single_process_groups(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(rotary_base, "_is_cpu", True)
        yield server_args


def hf_config_of(path):
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(path, trust_remote_code=False)


def build_model(path):
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
    return cls(config=hf_config_of(path), quant_config=None).eval()


def loaded_model(path):
    model = build_model(path)
    model.load_weights(read_tensors(path).items())
    return model


@pytest.fixture(scope="module")
def target_weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(V, H, generator=g), 0.5 * torch.randn(V, H, generator=g)  # input embeddings, lm_head


def lm_head_layer(weight: torch.Tensor):
    """SGLang's own vocab-parallel head (TP=1 here), holding `weight`."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(V, H, params_dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


@pytest.fixture()
def attached(sglang_env, ckpt, target_weights):
    """(SGLang DSpineDraftModel attached to the target head, reference drafter attached to the same target)."""
    from dspine.sglang import compat

    emb, head_w = target_weights
    model = loaded_model(ckpt)
    model.attach_target_head(lm_head_layer(head_w), tp_group=compat.tp_group())
    ref = load_checkpoint(ckpt, dtype=torch.float32)
    ref.attach_target(emb, head_w)
    return model, ref


# ------------------------------------------------------------------------------ registration
def test_registry_resolves_the_real_dflash_subclass(sglang_env):
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.registry import ModelRegistry

    from dspine.sglang import draft_model

    cls, arch = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
    assert arch == "DSpineDraftModel" and cls is draft_model.DSpineDraftModel
    assert issubclass(cls, DFlashDraftModel) and draft_model.EntryClass == [cls]


def test_the_dflash_worker_attribute_contract_holds(sglang_env, ckpt):
    from sglang.srt.models.dflash import DFlashDraftModel

    model = build_model(ckpt)
    for layer in model.layers:
        attn = layer.self_attn
        for name in ("kv_proj_only", "apply_k_norm", "apply_k_rope", "num_kv_heads", "head_dim", "attn",
                     "qkv_proj", "rotary_emb"):
            assert hasattr(attn, name), name
    for name in ("project_target_hidden", "prepare_context_hidden_for_kv", "supports_fused_context_kv",
                 "block_size", "num_context_features", "candidate_selector", "lm_head", "set_block_size",
                 "compute_candidates"):
        assert hasattr(model, name), name
    for name in ("get_input_embeddings", "is_nemotron_35_draft", "lilicorr"):  # 0.5.22 adds these to DFlash
        assert hasattr(model, name) == hasattr(DFlashDraftModel(hf_config_of(ckpt)), name), name
    assert model.block_size == N and model.num_context_features == 3
    assert model.candidate_selector.top_k == K and model.lm_head is None
    assert getattr(model, "lilicorr", None) is None and not getattr(model, "is_nemotron_35_draft", False)
    with pytest.raises(ValueError, match="trained for blocks of 8"):
        model.set_block_size(16)
    model.set_block_size(N)


def test_an_inherited_quant_config_is_ignored(sglang_env, ckpt, caplog):
    """SGLang hands the draft the target's --quantization by default; the small drafter stays unquantized."""
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
    model = cls(config=hf_config_of(ckpt), quant_config=SimpleNamespace())
    assert "runs unquantized" in caplog.text
    model.load_weights(read_tensors(ckpt).items())  # no quantization parameters to fill


# ------------------------------------------------------------------------------------ weights
def test_load_weights_maps_every_tensor_and_stacks_qkv_gate_up(sglang_env, ckpt):
    tensors = read_tensors(ckpt)
    model = build_model(ckpt)
    loaded = model.load_weights(tensors.items())
    params = dict(model.named_parameters())
    assert loaded == set(params)
    for i in range(5):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        torch.testing.assert_close(params[f"{attn}.qkv_proj.weight"], torch.cat(
            [tensors[f"{attn}.{p}_proj.weight"] for p in "qkv"]), rtol=0, atol=0)
        torch.testing.assert_close(params[f"{mlp}.gate_up_proj.weight"], torch.cat(
            [tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]]), rtol=0, atol=0)
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight", "mask_embedding", "transfer.proj.weight",
                 "injections.3.gate.bias", "injections.0.score_proj.weight", "transition.weight",
                 "confidence.weight", "confidence.bias", "layers.2.self_attn.o_proj.weight",
                 "layers.4.mlp.down_proj.weight", "layers.1.self_attn.k_norm.weight"):
        torch.testing.assert_close(params[name], tensors[name], rtol=0, atol=0)


@pytest.mark.parametrize("dropped", ["layers.2.self_attn.k_proj.weight", "injections.1.gate.bias",
                                     "transition.weight", "mask_embedding", "layers.0.mlp.up_proj.weight"])
def test_a_missing_tensor_is_named(sglang_env, ckpt, dropped):
    tensors = read_tensors(ckpt)
    del tensors[dropped]
    with pytest.raises(MissingTensorsError, match=dropped.replace(".", r"\.")):
        build_model(ckpt).load_weights(tensors.items())


@pytest.mark.parametrize("extra", ["injections.5.gate.weight", "successors.ids", "layers.0.self_attn.rotary.inv_freq"])
def test_an_unexpected_tensor_is_named(sglang_env, ckpt, extra):
    tensors = read_tensors(ckpt)
    tensors[extra] = torch.zeros(3)
    with pytest.raises(UnexpectedTensorsError, match=extra.replace(".", r"\.")):
        build_model(ckpt).load_weights(tensors.items())


def test_a_wrong_shape_is_named(sglang_env, ckpt):
    tensors = read_tensors(ckpt)
    tensors["transfer.proj.weight"] = torch.zeros(R + 1, H)
    with pytest.raises(TensorMismatchError, match=r"transfer\.proj\.weight"):
        build_model(ckpt).load_weights(tensors.items())


def test_full_tensor_fits_a_row_or_column_shard_only_at_the_tp_degree(sglang_env):
    from dspine.sglang.draft_weights import full_tensor_fits
    assert full_tensor_fits((8, 6), (8, 6), 1) and full_tensor_fits((8, 6), (8, 6), 2)
    assert full_tensor_fits((8, 6), (8, 3), 2) and full_tensor_fits((8, 6), (4, 6), 2)
    assert not full_tensor_fits((8, 6), (8, 3), 1)       # no TP: shapes must match
    assert not full_tensor_fits((8, 12), (8, 3), 2)      # a quarter is not a TP-2 shard
    assert not full_tensor_fits((8, 6), (4, 3), 2)       # sharded along two dims
    assert not full_tensor_fits((8, 6, 1), (8, 3), 2)


def test_under_tp_a_sharded_parameter_takes_its_slice_of_the_full_tensor(sglang_env, ckpt, monkeypatch):
    """A row-parallel `down_proj` built for TP 2 holds half the input dim: the full checkpoint tensor
    reaches the parameter's own loader (which narrows to its rank); a tensor of any other width is
    refused by name before any loader runs."""
    import dspine.sglang.draft_weights as weights_module
    monkeypatch.setattr(weights_module, "_loading_tp_size", lambda: 2)
    tensors = read_tensors(ckpt)
    name = "layers.4.mlp.down_proj.weight"
    full = tensors[name]

    def shard_model():
        model = build_model(ckpt)
        mlp = model.layers[4].mlp
        half = torch.nn.Parameter(torch.empty(full.shape[0], full.shape[1] // 2), requires_grad=False)
        half.weight_loader = lambda param, w: param.data.copy_(w.narrow(1, full.shape[1] // 2, full.shape[1] // 2))
        mlp.down_proj.weight = half  # rank 1 of 2
        return model

    model = shard_model()
    model.load_weights(tensors.items())
    torch.testing.assert_close(model.layers[4].mlp.down_proj.weight, full[:, full.shape[1] // 2:], rtol=0, atol=0)
    tensors[name] = torch.zeros(full.shape[0], full.shape[1] * 3 // 2)
    with pytest.raises(TensorMismatchError, match=r"down_proj\.weight.*per TP rank of 2"):
        shard_model().load_weights(tensors.items())


def test_later_weight_updates_may_be_partial(sglang_env, ckpt):
    model = loaded_model(ckpt)
    model.load_weights([("norm.weight", torch.full((H,), 2.0))])
    assert torch.equal(model.norm.weight, torch.full((H,), 2.0))
    with pytest.raises(UnexpectedTensorsError, match="bogus"):
        model.load_weights([("bogus", torch.zeros(1))])


def test_name_mapping_and_coverage_as_pure_functions(sglang_env, ckpt):
    from dspine.sglang.draft_weights import check_weight_coverage, checkpoint_names_of, expected_shards, map_weight_name

    assert map_weight_name("model.layers.3.self_attn.v_proj.weight") == ("layers.3.self_attn.qkv_proj.weight", "v")
    assert map_weight_name("layers.0.mlp.gate_proj.weight") == ("layers.0.mlp.gate_up_proj.weight", 0)
    assert map_weight_name("layers.0.self_attn.q_norm.weight") == ("layers.0.self_attn.q_norm.weight", None)
    assert map_weight_name("injections.2.out_proj.weight") == ("injections.2.out_proj.weight", None)
    assert expected_shards("layers.1.self_attn.qkv_proj.weight") == ("q", "k", "v")
    assert expected_shards("layers.1.mlp.gate_up_proj.weight") == (0, 1)
    names = list(read_tensors(ckpt))
    mapped = [map_weight_name(n) for n in names]
    assert sorted(checkpoint_names_of(p, s) for p, s in mapped) == sorted(names)  # a bijection
    params = sorted({p for p, _ in mapped})
    assert params == sorted(n for n, _ in build_model(ckpt).named_parameters())
    check_weight_coverage(params, mapped, [])
    with pytest.raises(MissingTensorsError, match=r"layers\.4\.mlp\.gate_proj\.weight"):
        check_weight_coverage(params, [m for m in mapped if m != ("layers.4.mlp.gate_up_proj.weight", 0)], [])
    with pytest.raises(UnexpectedTensorsError, match="confidence.extra"):
        check_weight_coverage(params, mapped, ["confidence.extra"])


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_draft_layers_attend_bidirectionally_without_a_layer_window(sglang_env, tmp_path, layer_type):
    """Every draft layer is built as DSpine trained it: ENCODER_ONLY (bidirectional in the block), no
    per-layer sliding window (the window is SGLang's compact draft cache). Also for a checkpoint whose
    config.json still says `sliding_attention`, which SGLang 0.5.17 builds as causal DECODER attention
    with a per-query window."""
    from sglang.srt.layers.radix_attention import AttentionType

    path = write_checkpoint(tmp_path / layer_type, dspine_cfg())
    config_file = tmp_path / layer_type / "config.json"
    data = json.loads(config_file.read_text())
    data.update(layer_types=[layer_type] * data["num_hidden_layers"], use_sliding_window=layer_type != "full_attention")
    config_file.write_text(json.dumps(data))
    model = build_model(path)
    for layer in model.layers:
        assert layer.self_attn.attn.attn_type == AttentionType.ENCODER_ONLY
        assert layer.self_attn.attn.sliding_window_size in (None, -1)


def test_the_dflash_config_mirror_is_required(sglang_env, tmp_path):
    from dspine.sglang.draft_weights import check_dflash_mirror, dspine_config_of

    path = write_checkpoint(tmp_path / "no_mirror", dspine_cfg(), mirror=False)
    with pytest.raises(ConfigError, match="no `dflash_config` block"):
        build_model(path)
    config = hf_config_of(path)
    config.dflash_config = {"block_size": N, "target_layer_ids": [1, 2, 4], "num_target_layers": TARGET_LAYERS,
                            "mask_token_id": 3}
    with pytest.raises(ConfigError, match="target_layer_ids"):
        check_dflash_mirror(config, dspine_config_of(config))


# ------------------------------------------------------------------------------------ forward
class PlainAttention(nn.Module):
    """Stands in for RadixAttention: each block's queries attend to its request's context K/V (as
    written into the draft KV cache) and bidirectionally within the block (DFlash's ENCODER_ONLY)."""

    def __init__(self, attn, context):
        super().__init__()
        self.layer_id, self.context = attn.layer_id, context
        self.num_heads, self.num_kv_heads, self.head_dim, self.scaling = (
            attn.tp_q_head_num, attn.tp_k_head_num, attn.head_dim, attn.scaling)

    def forward(self, q, k, v, forward_batch, **kwargs):
        n, blk, d = forward_batch.n_blocks, forward_batch.block_size, self.head_dim
        q = q.reshape(n, blk, self.num_heads, d).transpose(1, 2)
        k = k.reshape(n, blk, self.num_kv_heads, d).transpose(1, 2)
        v = v.reshape(n, blk, self.num_kv_heads, d).transpose(1, 2)
        ctx_k, ctx_v, valid = self.context[self.layer_id]
        keys, values = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        mask = torch.cat([valid[:, None, :].expand(n, blk, -1), torch.ones(n, blk, blk, dtype=torch.bool)], -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=self.scaling)
        return out.transpose(1, 2).reshape(n * blk, self.num_heads * d)


def test_forward_matches_the_reference_drafter_on_a_padded_batch(attached, target_weights):
    """Two real requests (context 5 and 3 tokens) plus one padded graph row: the SGLang model's hidden
    states of the real blocks equal the reference drafter's (mask embedding, layers, injection, norm)."""
    model, ref = attached
    emb, _ = target_weights
    g = torch.Generator().manual_seed(3)
    n_real, n, ctx_len = 2, 3, 5
    lengths = torch.tensor([5, 3, 0])
    ctx_hidden = torch.randn(n, ctx_len, 3 * H, generator=g)
    ctx_pos = torch.arange(ctx_len)[None].expand(n, -1)
    valid = ctx_pos < lengths[:, None]
    anchors = torch.tensor([11, 200, 7])
    block_ids = torch.full((n, N), ref.config.mask_token_id)
    block_ids[:, 0] = anchors
    block_pos = lengths[:, None] + torch.arange(N)[None]

    # Context K/V through SGLang's own model methods, as the worker materialises the draft KV cache.
    flat = ctx_hidden[valid]
    ctx_features = model.project_target_hidden(flat)
    context = {}
    for layer in model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx_features))
        k = attn.apply_k_rope(ctx_pos[valid], attn.apply_k_norm(k))  # what the worker writes per layer
        ck = torch.zeros(n, ctx_len, attn.num_kv_heads, attn.head_dim)
        cv = torch.zeros_like(ck)
        per_head = (-1, attn.num_kv_heads, attn.head_dim)
        ck[valid], cv[valid] = k.view(per_head), v.view(per_head)
        context[attn.attn.layer_id] = (ck.transpose(1, 2), cv.transpose(1, 2), valid)
        attn.attn = PlainAttention(attn.attn, context)
    out = model(block_ids.reshape(-1), block_pos.reshape(-1), SimpleNamespace(n_blocks=n, block_size=N),
                input_embeds=emb[block_ids].reshape(-1, H))
    got = out.hidden_states.view(n, N, H)[:n_real]

    with torch.no_grad():
        kv = ref.context_key_values(ref.project_context(ctx_hidden[:n_real]), ctx_pos[:n_real])
        mask = torch.cat([valid[:n_real, None, :].expand(n_real, N, -1), torch.ones(n_real, N, N, dtype=torch.bool)], 2)
        want = ref(anchors[:n_real, None], block_pos[:n_real], kv, mask).hidden
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert out.next_token_logits is None


def test_injection_equals_the_reference_on_the_padded_block_view(attached):
    model, ref = attached
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3 * N, H, generator=g)  # 3 blocks in bs x N row-major order; pretend block 2 is padding
    anchors = torch.tensor([5, 17, 0])
    table = model.transfer_table()
    for layer in range(5):
        inj = ref.injections[layer]
        want, _ = adjacent_injection_reference(x.view(-1, N, H), inj.score_proj.weight, ref.transfer_table(), anchors,
                                               inj.gate.weight, inj.gate.bias, inj.out_proj.weight, inj.top_k)
        got, _ = model.inject(layer, x, anchors, table)
        torch.testing.assert_close(got.view(-1, N, H), want, rtol=1e-5, atol=1e-5)
        # A block never sees another block: changing the padded block leaves the others untouched.
        y = x.clone()
        y[2 * N:] = 100.0
        torch.testing.assert_close(model.inject(layer, y, anchors, table)[0][: 2 * N], got[: 2 * N], rtol=0, atol=0)


def test_mask_slots_get_the_learned_mask_embedding():
    from dspine.sglang.draft_model import block_inputs

    emb = torch.randn(2 * N, H)
    mask = torch.randn(H)
    out = block_inputs(emb, mask, N).view(2, N, H)
    assert torch.equal(out[:, 0], emb.view(2, N, H)[:, 0])
    assert torch.equal(out[:, 1:], mask.expand(2, N - 1, H))


# --------------------------------------------------------------------- transfer table and TP
def test_transfer_table_is_built_from_the_target_head(attached):
    model, ref = attached
    torch.testing.assert_close(model.transfer_table(), ref.transfer_table(), rtol=1e-6, atol=1e-6)


def test_tp_sharded_head_gives_the_full_table_and_the_global_top_k(sglang_env, attached):
    """TP=2 simulated in one process with SGLang's own vocab-shard layout (padding included)."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    from dspine.sglang.draft_model import global_topk, transfer_table_from_head

    model, ref = attached
    vocab, tp = 250, 2  # padded to 256: rank 1 holds 122 real rows + 6 padding rows
    padded = pad_vocab_size(vocab)
    g = torch.Generator().manual_seed(5)
    full_w = torch.randn(vocab, H, generator=g)
    proj = model.transfer.proj.weight
    shards = [VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp) for rank in range(tp)]
    local_w = []
    for s in shards:
        w = torch.full((s.num_org_elements_padded, H), float("nan"))  # padding rows must never leak
        w[: s.num_org_elements] = full_w[s.org_vocab_start_index: s.org_vocab_end_index]
        local_w.append(w)
    hidden = torch.randn(6, H, generator=g)

    def gather_from(results):
        return lambda tensor, dim: torch.cat(results, dim)

    locals_u = [w[: s.num_org_elements_padded] @ proj.T for w, s in zip(local_w, shards)]
    table = transfer_table_from_head(local_w[0], proj, vocab, shard=shards[0], tp_size=tp,
                                     all_gather=gather_from(locals_u))
    torch.testing.assert_close(table, full_w @ proj.T, rtol=1e-6, atol=1e-6)

    per_rank = [global_topk(hidden, w, K, num_org=s.num_org_elements, org_start=s.org_vocab_start_index)
                for w, s in zip(local_w, shards)]
    vals_by_rank, ids_by_rank = [v for _, v in per_rank], [i for i, _ in per_rank]

    def gather_pairs(tensor, dim):
        return torch.cat(vals_by_rank if tensor.dtype.is_floating_point else ids_by_rank, dim)

    ids, vals = global_topk(hidden, local_w[0], K, num_org=shards[0].num_org_elements,
                            org_start=shards[0].org_vocab_start_index, tp_size=tp, all_gather=gather_pairs)
    want_vals, want_ids = (hidden @ full_w.T).topk(K, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(vals, want_vals, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_global_topk_on_the_triton_path_equals_the_torch_path(sglang_env, monkeypatch, tp):
    """`global_topk` with its local top-k on `kernels.logits_topk` (what CUDA runs; here the Triton
    interpreter, forced): the same global ids and values as the torch path and a full-vocabulary
    top-k, unsharded and from SGLang's vocab shards (TP=2 simulated, padding rows NaN)."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    import dspine.kernels.logits_topk as topk_module
    from dspine.sglang.draft_model import global_topk

    vocab, k = 250, 6
    g = torch.Generator().manual_seed(8)
    full_w, hidden = torch.randn(vocab, H, generator=g), torch.randn(9, H, generator=g)
    padded = pad_vocab_size(vocab)
    shards = [VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp) for rank in range(tp)]
    local_w = []
    for s in shards:
        w = torch.full((s.num_org_elements_padded, H), float("nan"))
        w[: s.num_org_elements] = full_w[s.org_vocab_start_index: s.org_vocab_end_index]
        local_w.append(w)
    calls = []
    real = topk_module.logits_topk
    monkeypatch.setattr(topk_module, "logits_topk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    found = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DSPINE_KERNELS", mode)
        per_rank = [global_topk(hidden, w, k, num_org=s.num_org_elements, org_start=s.org_vocab_start_index)
                    for w, s in zip(local_w, shards)]
        vals_by_rank, ids_by_rank = [v for _, v in per_rank], [i for i, _ in per_rank]

        def gather_pairs(tensor, dim, vals_by_rank=vals_by_rank, ids_by_rank=ids_by_rank):
            return torch.cat(vals_by_rank if tensor.dtype.is_floating_point else ids_by_rank, dim)

        found[mode] = global_topk(hidden, local_w[0], k, num_org=shards[0].num_org_elements,
                                  org_start=shards[0].org_vocab_start_index, tp_size=tp, all_gather=gather_pairs)
    assert len(calls) == tp + 1  # every local top-k of the triton pass (rank 0 twice)
    want_vals, want_ids = (hidden @ full_w.T).topk(k, dim=-1)
    for ids, vals in found.values():
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(vals, want_vals, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- token choice
def reference_tokens(ref, hidden_blocks, anchors, temperature, generator=None):
    logits = ref.logits(hidden_blocks[:, 1:])
    cfg = ref.config
    return select_tokens(logits, anchors, temperature, mode="transition", top_k=cfg.selection_top_k,
                         lam=cfg.transition_lambda, scorer=ref.transition, table=ref.transfer_table(),
                         generator=generator)


def test_in_graph_sampler_equals_select_tokens(attached):
    """DSpineDraftSampler as SGLang 0.5.17's capture hook calls it: (hidden [n*N, H], input_ids [n*N]),
    graph batch 4 of which 3 rows are real."""
    from dspine.sglang.dspine_worker_v2 import DSpineDraftSampler

    model, ref = attached
    g = torch.Generator().manual_seed(6)
    n, n_real = 4, 3
    hidden = torch.randn(n * N, H, generator=g)
    input_ids = torch.randint(0, V, (n * N,), generator=g)
    sampler = DSpineDraftSampler(draft_model=model, block_size=N, max_bs=8, device="cpu")
    assert sampler.out.shape == (8 * (N - 1),) and sampler.out.dtype == torch.int64
    sampler(hidden, input_ids)
    got = sampler.out[: n * (N - 1)].view(n, N - 1)[:n_real]
    anchors = input_ids.view(n, N)[:n_real, 0]
    want = reference_tokens(ref, hidden.view(n, N, H)[:n_real], anchors, torch.zeros(n_real)).tokens
    assert torch.equal(got, want)
    argmax = ref.logits(hidden.view(n, N, H)[:n_real, 1:]).argmax(-1)
    assert not torch.equal(want, argmax), "transitions should change some choice, or this test proves nothing"


def test_copy_candidates_in_the_sampler_equal_select_tokens_with_copies(attached):
    """Copy candidates in SGLang: the worker's SlotTokenHistory (prefill, then a commit) feeds the
    in-graph sampler, whose tokens equal the reference `select_tokens` with the same copies."""
    from dspine.model.copy_candidates import CopyTables, copy_candidates
    from dspine.sglang.dspine_worker_v2 import DSpineDraftSampler
    from dspine.sglang.token_history import SlotTokenHistory

    model, ref = attached
    cfg = model.dspine_config
    g = torch.Generator().manual_seed(8)
    span = torch.randint(0, V, (12,), generator=g).tolist()
    prompts = [span + [7, 9] + span[:4], torch.randint(0, V, (9,), generator=g).tolist(), span * 2]
    slots, firsts = torch.tensor([5, 2, 6]), torch.tensor([span[4], 11, span[0]])
    history = SlotTokenHistory(pool_rows=8, max_context_len=64, block_size=N, window=32, max_bs=4, device="cpu")
    model.attach_token_history(history)
    history.write_prefill(slots, prompts, firsts)
    prefix = torch.tensor([len(p) for p in prompts])
    committed = torch.tensor([(span * 2)[5:5 + N], [12] * N, (span * 2)[1:1 + N]])
    history.write_committed(slots, prefix, committed)
    commit = torch.tensor([3, 1, 2])
    # the next step: anchors are each row's last committed token, at position prefix + commit
    truth = [p + [f] + committed[b, : commit[b]].tolist() for b, (p, f) in enumerate(zip(prompts, firsts.tolist()))]
    history.prepare_draft(slots, prefix + commit)
    n = 4                                                   # graph batch: 3 real rows and a padded one
    hidden = torch.randn(n * N, H, generator=g)
    input_ids = torch.randint(0, V, (n * N,), generator=g)
    input_ids.view(n, N)[:3, 0] = torch.tensor([t[-1] for t in truth])
    sampler = DSpineDraftSampler(draft_model=model, block_size=N, max_bs=8, device="cpu")
    sampler(hidden, input_ids)
    got = sampler.out[: n * (N - 1)].view(n, N - 1)[:3]

    recent = [t[-32:] for t in truth]
    rows = torch.tensor([r + [0] * (32 - len(r)) for r in recent])
    logits = ref.logits(hidden.view(n, N, H)[:3, 1:])
    copies = copy_candidates(rows, torch.tensor([len(r) for r in recent]), cfg, CopyTables.from_config(cfg), N - 1,
                             logits[:, 0].argmax(-1))
    assert (copies.ids[0, 0] >= 0).any() and (copies.ids[2, 0] >= 0).any(), "the repeated spans should give copies"
    want = select_tokens(logits, input_ids.view(n, N)[:3, 0], torch.zeros(3), mode="transition",
                         top_k=cfg.selection_top_k, lam=cfg.transition_lambda, scorer=ref.transition,
                         table=ref.transfer_table(), copies=copies).tokens
    assert torch.equal(got, want)
    assert not torch.equal(want, reference_tokens(ref, hidden.view(n, N, H)[:3], input_ids.view(n, N)[:3, 0],
                                                  torch.zeros(3)).tokens), "copies should change some choice"


def test_the_triton_kernels_run_behind_the_same_seams(attached, monkeypatch):
    """What CUDA runs (`dispatch.use_triton`): the fused injection and the Triton lattice walk, here in
    the Triton interpreter, through the model's `inject` and the in-graph sampler."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")
    from dspine.sglang.dspine_worker_v2 import DSpineDraftSampler

    model, ref = attached
    g = torch.Generator().manual_seed(12)
    n = 2
    x = torch.randn(n * N, H, generator=g)
    input_ids = torch.randint(0, V, (n * N,), generator=g)
    anchors = input_ids.view(n, N)[:, 0]
    monkeypatch.setenv("DSPINE_KERNELS", "torch")
    want_x, _ = model.inject(1, x, anchors, model.transfer_table())
    want_tokens = reference_tokens(ref, x.view(n, N, H), anchors, torch.zeros(n)).tokens
    monkeypatch.setenv("DSPINE_KERNELS", "triton")
    torch.testing.assert_close(model.inject(1, x, anchors, model.transfer_table())[0], want_x, rtol=1e-5, atol=1e-5)
    sampler = DSpineDraftSampler(draft_model=model, block_size=N, max_bs=n, device="cpu")
    sampler(x, input_ids)
    assert torch.equal(sampler.out.view(n, N - 1), want_tokens)


def test_selector_seam_equals_select_tokens_greedy_and_sampled(attached):
    """compute_candidates + build_lattice + sample_path (SGLang's selector contract) give the same
    tokens and the same proposal q as select_tokens, Viterbi rows and sampled rows mixed."""
    model, ref = attached
    g = torch.Generator().manual_seed(8)
    bs = 5
    blocks = torch.randn(bs, N, H, generator=g)
    anchors = torch.randint(0, V, (bs,), generator=g)
    temperature = torch.tensor([0.0, 0.7, 1.0, 0.0, 1.3])
    want = reference_tokens(ref, blocks, anchors, temperature, torch.Generator().manual_seed(99))
    uniforms = torch.rand(bs, N - 1, generator=torch.Generator().manual_seed(99))
    selector = model.candidate_selector
    ids, unary = model.compute_candidates(blocks[:, 1:].reshape(-1, H))
    ids, unary = ids.view(bs, N - 1, K), unary.view(bs, N - 1, K)
    assert torch.equal(ids, want.cand_ids)
    scores = selector.build_lattice(candidate_ids=ids, unary_logits=unary, hidden_states=blocks[:, 1:],
                                    anchor_token_ids=anchors)
    assert scores.shape == (bs, N - 1, K, K) and scores.dtype == torch.float32
    tokens, q = selector.sample_path(candidate_ids=ids, scores=scores, uniforms=uniforms,
                                     temperatures=temperature.clamp_min(1e-5), greedy_mask=temperature <= 0)
    assert torch.equal(tokens, want.tokens)
    torch.testing.assert_close(q, want.q, rtol=0, atol=0)


def test_sglang_selector_sampler_runs_dspine_selection(attached):
    """0.5.20+: SGLang's own in-graph `_SelectorDraftSampler` with the DSpine model equals
    select_tokens for greedy rows, and walks DSpine's sampled path with the uniforms it drew."""
    from dspine.sglang import compat

    if not compat.has_selector_seam():
        pytest.skip("SGLang < 0.5.20 has no selector seam (the DSPINE worker folds its own sampler)")
    from sglang.srt.speculative.dflash_worker_v2 import _SelectorDraftSampler

    model, ref = attached
    g = torch.Generator().manual_seed(9)
    n = 3
    hidden = torch.randn(n * N, H, generator=g)
    input_ids = torch.randint(0, V, (n * N,), generator=g)
    anchors = input_ids.view(n, N)[:, 0]
    sampler = _SelectorDraftSampler(draft_model=model, block_size=N, max_bs=4, device="cpu", sampling_enabled=True)
    sampler.stage_sampling_params(bs=n, sampling_info=None)  # all greedy
    sampler(hidden, input_ids)
    want = reference_tokens(ref, hidden.view(n, N, H), anchors, torch.zeros(n))
    assert torch.equal(sampler.out[: n * (N - 1)].view(n, N - 1), want.tokens)

    sampler.temperatures[:n] = torch.tensor([0.8, 1.0, 1.5])
    sampler.greedy_mask[:n] = False
    sampler(hidden, input_ids)
    uniforms = sampler.uniforms[:n].clone()
    logits = ref.logits(hidden.view(n, N, H)[:, 1:])
    unary, cand = logits.topk(K, dim=-1)
    prev = torch.cat([anchors[:, None, None].expand(n, 1, K), cand[:, :-1]], 1)
    pair = ref.transition.pair(ref.transfer_table(), prev, cand)
    choice, q = transition_path_reference(unary, pair, 1.0, sampler.temperatures[:n], uniforms)
    assert torch.equal(sampler.out[: n * (N - 1)].view(n, N - 1), cand.gather(-1, choice[..., None]).squeeze(-1))
    torch.testing.assert_close(sampler.q_out[:n], q, rtol=1e-6, atol=1e-6)
    assert torch.equal(sampler.candidate_out[:n], cand)


# ------------------------------------------------------------------------------------- worker
def bare_worker(model, **attrs):
    """A DSpineWorkerV2 without DFlashWorkerV2.__init__ (that one builds GPU runners)."""
    from dspine.sglang.dspine_worker_v2 import DSpineWorkerV2

    worker = object.__new__(DSpineWorkerV2)
    worker.__dict__.update(draft_model=model, block_size=N, device=torch.device("cpu"), **attrs)
    return worker


def target_worker_with(head, **config_changes):
    """The slice of SGLang's target TpModelWorker the DSPINE worker reads at attach time."""
    from transformers import Qwen3Config

    fields = {k: v for k, v in TARGET.items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_config = Qwen3Config(**{**fields, **config_changes})
    return SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(lm_head=head),
                                                        model_config=SimpleNamespace(hf_config=hf_config)))


def test_worker_takes_any_constructor_signature():
    import inspect

    from dspine.sglang.dspine_worker_v2 import DSpineWorkerV2

    params = inspect.signature(DSpineWorkerV2.__init__).parameters
    assert [p.kind for p in params.values()][1:] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def test_worker_attaches_the_target_head_and_refreshes_the_table_when_serving(sglang_env, ckpt, target_weights,
                                                                               monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    _, head_w = target_weights
    model = loaded_model(ckpt)
    head = lm_head_layer(head_w)
    target = target_worker_with(head)
    worker = bare_worker(model, _target_worker=target)
    worker._attach_target_to_draft()
    assert model.target_head is head and model.lm_head is None
    proj = model.transfer.proj.weight
    torch.testing.assert_close(model.transfer_table(), head_w @ proj.T)
    table_ptr = model.transfer_table().data_ptr()

    calls = []
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation",
                        lambda self, batch, *a, **k: calls.append(batch) or "out")
    head.weight.data.mul_(2.0)  # an in-place weight write that bumps no version (as weight loaders do)
    assert worker.forward_batch_generation("batch", on_publish=None) == "out" and calls == ["batch"]
    torch.testing.assert_close(model.transfer_table(), 2 * head_w @ proj.T)  # the first serving step rebuilt it
    assert model.transfer_table().data_ptr() == table_ptr  # same buffer: captured graphs see the new values
    head.weight.data.mul_(0.5)
    worker.forward_batch_generation("batch")
    torch.testing.assert_close(model.transfer_table(), 2 * head_w @ proj.T)  # later steps: only on a detected change
    model.invalidate_transfer_table()
    worker.forward_batch_generation("batch")
    torch.testing.assert_close(model.transfer_table(), head_w @ proj.T)


def test_worker_writes_the_token_history_at_prefill_and_after_each_decode_step():
    """The worker's wrapper around a step: a prefill writes the prompt and the first token; a decode
    step points the draft at (slots, seq_lens) before it runs and writes the committed tokens after."""
    from dspine.sglang.dspine_worker_v2 import DSpineWorkerV2
    from dspine.sglang.token_history import SlotTokenHistory

    class Mode:
        def __init__(self, extend): self.extend = extend
        def is_extend(self): return self.extend
        def is_idle(self): return False

    worker = DSpineWorkerV2.__new__(DSpineWorkerV2)
    history = SlotTokenHistory(pool_rows=4, max_context_len=32, block_size=4, window=16, max_bs=4, device="cpu")
    worker.__dict__["_history"] = history
    seen = []

    def step(batch, *args, **kwargs):
        seen.append((history.rows[:2].tolist(), history.lengths[:2].tolist()))
        return batch.result

    worker.__dict__["_forward_step"] = step
    reqs = [SimpleNamespace(get_fill_ids=lambda: [5, 6, 7]), SimpleNamespace(get_fill_ids=lambda: [8])]
    prefill = SimpleNamespace(forward_mode=Mode(True), reqs=reqs, req_pool_indices=torch.tensor([3, 1]),
                              result=SimpleNamespace(next_token_ids=torch.tensor([9, 10])))
    worker.forward_batch_generation(prefill)
    decode = SimpleNamespace(forward_mode=Mode(False), reqs=reqs, req_pool_indices=torch.tensor([3, 1]),
                             seq_lens=torch.tensor([3, 1]),
                             result=SimpleNamespace(next_token_ids=torch.tensor([[11, 12, 13, 14], [15, 16, 17, 18]])))
    worker.forward_batch_generation(decode)
    assert seen[-1] == ([3, 1], [4, 2])                     # the anchors (9, 10) are the histories' last tokens
    assert history.ids[3, :8].tolist() == [5, 6, 7, 9, 11, 12, 13, 14]
    assert history.ids[1, :6].tolist() == [8, 10, 15, 16, 17, 18]


@pytest.mark.parametrize("tp", [1, 2])
def test_worker_serves_copy_candidates_at_tp_1_and_without_them_above(sglang_env, monkeypatch, caplog, tp):
    """A drafter shipped with copy candidates on serves at any --tp: TP 1 attaches the token history
    the draft graph reads; above it the worker logs why and serves without copies."""
    import logging

    from dspine.sglang import compat
    from dspine.sglang.token_history import SlotTokenHistory

    attached_histories = []
    model = SimpleNamespace(dspine_config=dspine_cfg(copy_candidates=True),
                            attach_token_history=attached_histories.append)
    pool = torch.zeros(6, 64, dtype=torch.int32)
    target = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=pool)))
    worker = bare_worker(model, _target_worker=target, server_args=SimpleNamespace(max_running_requests=4))
    monkeypatch.setattr(compat, "tp_group", lambda: SimpleNamespace(world_size=tp))
    monkeypatch.setattr(compat, "decode_graph_max_bs", lambda: 8)
    with caplog.at_level(logging.INFO, logger="dspine.sglang.dspine_worker_v2"):
        worker._attach_token_history()
    if tp == 1:
        assert isinstance(worker._history, SlotTokenHistory) and attached_histories == [worker._history]
        assert "copy candidates on" in caplog.text
    else:
        assert worker._history is None and attached_histories == []
        assert "need tensor parallel size 1 (this server: 2); serving without them" in caplog.text


def test_worker_refuses_a_foreign_draft_and_a_wrong_target(sglang_env, ckpt, target_weights):
    from dspine.model.checkpoint import IncompatibleTargetError

    target = target_worker_with(lm_head_layer(target_weights[1]))
    with pytest.raises(TypeError, match="DSpineDraftModel"):
        bare_worker(nn.Linear(2, 2), _target_worker=target)._attach_target_to_draft()
    deeper = target_worker_with(lm_head_layer(target_weights[1]), num_hidden_layers=TARGET_LAYERS + 2)
    with pytest.raises(IncompatibleTargetError, match="num_target_layers"):
        bare_worker(loaded_model(ckpt), _target_worker=deeper)._attach_target_to_draft()
    small = SimpleNamespace(weight=torch.zeros(V - 1, H))
    with pytest.raises(ValueError, match="trained for"):
        loaded_model(ckpt).attach_target_head(small)


def test_0517_token_choice_seams(attached, monkeypatch):
    """Where SGLang has no selector seam (0.5.17), the worker's own sampler is folded into the graph and
    the eager fallback reads the anchors from the block-id buffer; both equal select_tokens. Forced here
    in every version by pretending the seam is absent."""
    from dspine.sglang import compat
    from dspine.sglang.dspine_worker_v2 import DSpineDraftSampler

    model, ref = attached
    monkeypatch.setattr(compat, "has_selector_seam", lambda: False)
    monkeypatch.setattr(compat, "decode_graph_max_bs", lambda: 6)
    bs = 3
    g = torch.Generator().manual_seed(10)
    block_ids = torch.randint(0, V, (bs + 2, N), generator=g)  # buffer larger than the batch
    worker = bare_worker(model, _draft_block_ids_buf=block_ids)
    sampler = worker._maybe_build_draft_sampler()
    assert isinstance(sampler, DSpineDraftSampler) and sampler.out.shape == (6 * (N - 1),)
    hidden = torch.randn(bs, N, H, generator=g)
    got = worker._greedy_sample_from_vocab_parallel_head(hidden_states=hidden[:, 1:].reshape(-1, H), lm_head=None)
    want = reference_tokens(ref, hidden, block_ids[:bs, 0], torch.zeros(bs)).tokens
    assert got.shape == (bs * (N - 1),) and torch.equal(got.view(bs, N - 1), want)
    monkeypatch.setenv("SGLANG_DFLASH_EAGER_DRAFT_SAMPLER", "1")
    assert worker._maybe_build_draft_sampler() is None


def test_argmax_ablation_and_seam_versions_leave_sglang_in_charge(attached, monkeypatch):
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dspine.sglang import compat

    model, _ = attached
    calls = []
    monkeypatch.setattr(DFlashWorkerV2, "_maybe_build_draft_sampler", lambda self: calls.append("build") or "sglang")
    monkeypatch.setattr(DFlashWorkerV2, "_greedy_sample_from_vocab_parallel_head",
                        lambda self, **kw: calls.append("greedy") or "sglang")
    worker = bare_worker(model)
    monkeypatch.setattr(compat, "has_selector_seam", lambda: True)  # 0.5.20+: SGLang runs our selector
    assert worker._maybe_build_draft_sampler() == "sglang"
    monkeypatch.setattr(compat, "has_selector_seam", lambda: False)
    model.candidate_selector = None  # selection="argmax": SGLang's own argmax head in every version
    assert worker._greedy_sample_from_vocab_parallel_head(hidden_states=torch.zeros(1, H), lm_head=None) == "sglang"
    assert calls == ["build", "greedy"]


@pytest.mark.parametrize("post_kwarg", [False, True])  # 0.5.17 / 0.5.22 call signatures
def test_replayssm_commit_goes_through_spec_utils(sglang_env, ckpt, monkeypatch, post_kwarg):
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    seen, fallback = [], []
    monkeypatch.setattr(spec_utils, "commit_mamba_states_after_verify", lambda *a: seen.append(a))
    monkeypatch.setattr(DFlashWorkerV2, "_update_target_mamba_state_after_verify",
                        lambda self, **kw: fallback.append(kw))
    pool = SimpleNamespace(replayssm_cache_base=torch.zeros(4), replayssm_spec_fold=False)
    target = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_pool=pool)))
    worker = bare_worker(build_model(ckpt), _target_worker=target, _need_mamba_verify_commit=True)
    batch = SimpleNamespace(seq_lens=torch.tensor([10, 20]))
    commit_lens = torch.tensor([3, 1], dtype=torch.int32)
    extra = {"seq_lens_post_verify": torch.tensor([13, 21])} if post_kwarg else {}
    worker._update_target_mamba_state_after_verify(batch=batch, seq_lens_pre_verify=batch.seq_lens,
                                                   commit_lens=commit_lens, **extra)
    (args,) = seen
    assert args[0] is target and args[1] is batch and args[2] is commit_lens and args[4] == N
    assert torch.equal(args[3], torch.arange(2 * N).view(2, N))
    assert fallback == []

    pool.replayssm_cache_base = None  # no ReplaySSM: DFlash's own commit, arguments passed through
    worker._update_target_mamba_state_after_verify(batch=batch, seq_lens_pre_verify=batch.seq_lens,
                                                   commit_lens=commit_lens, **extra)
    assert len(seen) == 1 and len(fallback) == 1 and set(fallback[0]) == {"batch", "seq_lens_pre_verify",
                                                                          "commit_lens", *extra}
    worker._need_mamba_verify_commit = False
    worker._update_target_mamba_state_after_verify(batch=batch, seq_lens_pre_verify=batch.seq_lens,
                                                   commit_lens=commit_lens, **extra)
    assert len(seen) == 1 and len(fallback) == 1


def test_confidence_record_reaches_each_request_through_sglangs_collector(sglang_env, ckpt, target_weights,
                                                                           monkeypatch):
    """DSPINE_RECORD_CONFIDENCE=1: the confidence logits written next to the candidates (as the draft
    graph does) reach every request's `customized_info` (-> meta_info) through SGLang's own collector,
    equal to the reference drafter's confidence head, with accepted drafts = SGLang's commit length - 1.
    Prefill steps and recording off attach nothing."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dspine.sglang import compat

    emb, head_w = target_weights
    bs, g = 3, torch.Generator().manual_seed(12)
    hidden = torch.randn(bs * (N - 1), H, generator=g)
    commit = torch.tensor([1, 4, N], dtype=torch.int32)

    def fake_step(self, batch, *args, **kwargs):
        self.draft_model.compute_candidates(hidden)  # the draft graph's candidate step
        return SimpleNamespace(accept_lens=commit, logits_output=LogitsProcessorOutput(next_token_logits=None))

    def worker(record: str):
        monkeypatch.setenv("DSPINE_RECORD_CONFIDENCE", record)
        w = bare_worker(loaded_model(ckpt), _target_worker=target_worker_with(lm_head_layer(head_w)),
                        server_args=SimpleNamespace(max_running_requests=5))
        w._attach_target_to_draft()
        return w

    monkeypatch.setattr(compat, "decode_graph_max_bs", lambda: 4)
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", fake_step)
    decode, prefill = SimpleNamespace(is_extend=lambda: False), SimpleNamespace(is_extend=lambda: True)

    recording = worker("1")
    assert recording.draft_model._confidence_buf.shape == (5 * (N - 1),)  # max(running requests, graph bs) rows
    result = recording.forward_batch_generation(SimpleNamespace(forward_mode=decode))
    reqs = [SimpleNamespace(customized_info=None) for _ in range(bs)]
    for i, req in enumerate(reqs):
        SchedulerBatchResultProcessor._maybe_collect_customized_info(None, i, req, result.logits_output)
    ref = load_checkpoint(ckpt, dtype=torch.float32)
    want = ref.confidence_logits(hidden).view(bs, N - 1)
    for i, req in enumerate(reqs):
        assert req.customized_info["dspine_accept_lens"] == [int(commit[i]) - 1]
        (row,) = req.customized_info["dspine_confidence_logits"]
        assert isinstance(row, list) and len(row) == N - 1
        torch.testing.assert_close(torch.tensor(row), want[i], rtol=1e-5, atol=1e-5)

    assert recording.forward_batch_generation(SimpleNamespace(forward_mode=prefill)).logits_output.customized_info \
        is None
    assert worker("0").forward_batch_generation(SimpleNamespace(forward_mode=decode)).logits_output.customized_info \
        is None


def test_gdn_track_slots_are_rebuilt_before_verify_where_dflash_does_not(sglang_env, ckpt, monkeypatch):
    """ReplaySSM target: before a verify step the worker rebuilds the batch's GDN track indices through
    spec_utils (before SGLang's step runs), where DFlash's own verify preparation does not do it
    (0.5.17); never on prefill, without ReplaySSM, or where SGLang does it itself."""
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from dspine.sglang import compat

    order = []
    monkeypatch.setattr(spec_utils, "prepare_mamba_track_for_verify", lambda batch: order.append(("track", batch)))
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", lambda self, batch, *a, **k: order.append(
        ("step", batch)) or SimpleNamespace(accept_lens=None, logits_output=None))
    pool = SimpleNamespace(replayssm_cache_base=torch.zeros(4), replayssm_spec_fold=False)
    target = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=SimpleNamespace(mamba_pool=pool)))
    worker = bare_worker(build_model(ckpt), _target_worker=target, _need_mamba_verify_commit=True)
    worker.draft_model.ensure_transfer_table = lambda serving: None
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False))
    prefill = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True, is_idle=lambda: False))

    monkeypatch.setattr(compat, "dflash_verify_refreshes_mamba_track", lambda: False)  # 0.5.17's DFlash
    worker.forward_batch_generation(decode)
    assert order == [("track", decode), ("step", decode)]
    order.clear()
    worker.forward_batch_generation(prefill)
    mixed = SimpleNamespace(forward_mode=decode.forward_mode, is_extend_in_batch=True)  # DFlash prefills these
    worker.forward_batch_generation(mixed)
    pool.replayssm_cache_base = None  # not a ReplaySSM target
    worker.forward_batch_generation(decode)
    assert order == [("step", prefill), ("step", mixed), ("step", decode)]

    pool.replayssm_cache_base = torch.zeros(4)
    monkeypatch.setattr(compat, "dflash_verify_refreshes_mamba_track", lambda: True)  # 0.5.20+: SGLang does it
    order.clear()
    worker.forward_batch_generation(decode)
    assert order == [("step", decode)]


def test_track_refresh_shim_matches_the_installed_dflash():
    from dspine.sglang import compat

    # 0.5.17's DFlash verify does not rebuild the track slots; 0.5.22's does (dflash_info.prepare_for_verify).
    assert compat.dflash_verify_refreshes_mamba_track() == (compat.sglang_version() >= "0.5.20")


def test_first_layer_candidates_flow_through_the_layers(sglang_env, target_weights, tmp_path, monkeypatch):
    """injection_candidates="first_layer": `inject` at layer 0 returns the top-k candidates and later
    layers re-weight them; every layer equals the reference drafter's, and the candidates are layer 0's.
    The fused Triton path (interpreter on CPU) gives the same rows and candidate sets."""
    import os

    from dspine.sglang import compat

    emb, head_w = target_weights
    path = write_checkpoint(tmp_path / "first", dspine_cfg(injection_candidates="first_layer"))
    model = loaded_model(path)
    model.attach_target_head(lm_head_layer(head_w), tp_group=compat.tp_group())
    ref = load_checkpoint(path, dtype=torch.float32)
    ref.attach_target(emb, head_w)
    x = torch.randn(3 * N, H, generator=torch.Generator().manual_seed(8))
    anchors = torch.tensor([5, 17, 0])
    cands = ref_cands = None
    for layer in range(5):
        got, cands = model.inject(layer, x, anchors, model.transfer_table(), cands)
        want, _, ref_cands = ref.injections[layer].forward_with_candidates(
            x.view(-1, N, H), ref.transfer_table(), anchors, need_scores=False, candidates=ref_cands)
        torch.testing.assert_close(got.view(-1, N, H), want, rtol=1e-5, atol=1e-5)
        assert cands.shape == (3, N - 1, K) and torch.equal(cands, ref_cands)
        if layer == 0:
            first = cands
        assert cands is first  # found once, reused after
        x = got
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    monkeypatch.setenv("DSPINE_KERNELS", "triton")
    y, fused = torch.randn(3 * N, H, generator=torch.Generator().manual_seed(8)), None
    for layer in range(5):
        want, _ = model.inject(layer, y, anchors, model.transfer_table(), None if layer == 0 else first)
        got, fused = model.inject(layer, y, anchors, model.transfer_table(), fused)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(fused[:, 1:].sort(-1).values, first[:, 1:].sort(-1).values)
        y = got
