"""SGLang's `DSpineDraftModel` at the published drafter shapes, built on the meta device (no memory).

For our two published targets, Qwen3-8B and the hybrid Qwen3.8-27B: the drafter config is what
`dspine train` makes of the packaged training config and the target's text config; its checkpoint
directory holds the `config.json` a saved drafter has (`checkpoint.hf_config`, no weights); the
serving preset's flags (plus the CPU stand-ins of test_sglang_server_args.py) are resolved and
published by SGLang's own parser; then SGLang's registry class is built as the draft worker builds
it, under `torch.device("meta")`, with a world-1 gloo group and the rotary CPU stand-in of
test_sglang_draft_model.py.

Every expectation is written from the published numbers in `TARGETS` (independent formulas, never
read back from the model): SGLang's parameter names and fused shapes, the mapping of every tensor of a
saved reference checkpoint onto them (`draft_weights`: none missing, none extra, shard shapes adding
up; then SGLang's own weight loaders on meta tensors), the exact parameter count (27B: ~2B), the
captured target layers and window SGLang reads, the target head attaching (vocab and hidden equal
to the target's), and that nothing was allocated.
"""

from __future__ import annotations

import importlib.metadata
import json
import resource
from collections import defaultdict
from dataclasses import dataclass

import pytest

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from dspine.model.checkpoint import expected_shapes, hf_config  # noqa: E402
from dspine.model.config import DSpineConfig  # noqa: E402
from dspine.serve import launch as serving_launch, presets as serving_presets  # noqa: E402
from dspine.sglang.draft_weights import expected_shards, map_weight_name  # noqa: E402
from dspine.train.config import TrainConfig  # noqa: E402
from sglang_cpu import publish_args, single_process_groups  # noqa: E402


@dataclass(frozen=True)
class Published:
    """A published target and the drafter shape we publish for it (tests/test_real_shapes.py: same numbers)."""

    preset: str
    train_config: str
    target: dict               # the target's config.json
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    max_positions: int
    window: int
    target_layer_ids: tuple[int, ...]
    drafter_params: int
    mask_token_id: int         # no shape depends on it; any unused id below the vocabulary
    cpu_flags: tuple[str, ...] = ()
    draft_layers: int = 5
    block: int = 16
    rank: int = 256
    top_k: int = 8


QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN38_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": False,
              "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
                              "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
                              "head_dim": 256, "vocab_size": 248320, "max_position_embeddings": 262144,
                              "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                                  "partial_rotary_factor": 0.25},
                              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
                              "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                              "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                              "linear_value_head_dim": 128, "torch_dtype": "bfloat16"}}

TARGETS = {
    "qwen3-8b": Published(
        preset="qwen3-8b", train_config="qwen3-8b-dspine", target=QWEN3_8B, hidden=4096, layers=36, heads=32,
        kv_heads=8, head_dim=128, intermediate=12288, vocab=151936, rope_theta=1e6, max_positions=40960,
        window=2048, target_layer_ids=(1, 9, 17, 25, 33), drafter_params=1_149_383_937, mask_token_id=151654),
    # CPU stand-in (as test_sglang_server_args.py): no mamba extra_buffer snapshots on CPU, so overlap off.
    "qwen3.8-27b": Published(
        preset="qwen3.8-27b", train_config="qwen3.8-27b-dspine", target=QWEN38_27B, hidden=5120, layers=64,
        heads=24, kv_heads=4, head_dim=256, intermediate=17408, vocab=248320, rope_theta=1e7,
        max_positions=262144, window=8192, target_layer_ids=(1, 16, 31, 46, 61), drafter_params=1_987_216_897,
        mask_token_id=248070, cpu_flags=("--disable-overlap-schedule",)),
}
CPU = ["--device", "cpu", "--skip-tokenizer-init"]


# ------------------------------------------------------------------ independent expectations
def sglang_shapes(p: Published) -> dict[str, tuple[int, ...]]:
    """SGLang's parameters (DFlash's layers with q/k/v and gate/up fused, plus DSpine's modules)."""
    h, q, kv, r = p.hidden, p.heads * p.head_dim, p.kv_heads * p.head_dim, p.rank
    shapes = {"fc.weight": (h, len(p.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
              "mask_embedding": (h,), "transfer.proj.weight": (r, h), "transition.weight": (r, r),
              "confidence.weight": (1, h), "confidence.bias": (1,)}
    for i in range(p.draft_layers):
        layer = f"layers.{i}"
        shapes.update({
            f"{layer}.input_layernorm.weight": (h,), f"{layer}.post_attention_layernorm.weight": (h,),
            f"{layer}.self_attn.qkv_proj.weight": (q + 2 * kv, h), f"{layer}.self_attn.o_proj.weight": (h, q),
            f"{layer}.self_attn.q_norm.weight": (p.head_dim,), f"{layer}.self_attn.k_norm.weight": (p.head_dim,),
            f"{layer}.mlp.gate_up_proj.weight": (2 * p.intermediate, h),
            f"{layer}.mlp.down_proj.weight": (h, p.intermediate),
            f"injections.{i}.score_proj.weight": (r, h), f"injections.{i}.gate.weight": (h, h + r),
            f"injections.{i}.gate.bias": (h,), f"injections.{i}.out_proj.weight": (h, r),
        })
    return shapes


def checkpoint_shapes(p: Published) -> dict[str, tuple[int, ...]]:
    """A saved reference checkpoint's tensors: the SGLang layout with q/k/v and gate/up unfused."""
    q, kv, i = p.heads * p.head_dim, p.kv_heads * p.head_dim, p.intermediate
    shapes = {}
    for name, shape in sglang_shapes(p).items():
        if ".qkv_proj." in name:
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[name.replace("qkv_proj", proj)] = (rows, p.hidden)
        elif ".gate_up_proj." in name:
            for proj in ("gate_proj", "up_proj"):
                shapes[name.replace("gate_up_proj", proj)] = (i, p.hidden)
        else:
            shapes[name] = shape
    return shapes


def parameter_count(p: Published) -> int:
    """Closed form, by component (no vocabulary-sized tensor: embeddings and lm_head are the target's)."""
    h, q, kv, r, i = p.hidden, p.heads * p.head_dim, p.kv_heads * p.head_dim, p.rank, p.intermediate
    layer = 2 * h * q + 2 * h * kv + 2 * p.head_dim + 3 * h * i + 2 * h
    injection = r * h + (h + r) * h + h + h * r
    return p.draft_layers * (layer + injection) + len(p.target_layer_ids) * h * h + 3 * h + r * h + r * r + h + 1


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def drafter_config(p: Published, target_dir) -> DSpineConfig:
    """The drafter `dspine train` makes: packaged training config over the target's text config
    (what AutoModelForCausalLM gives the trainer)."""
    text = AutoConfig.from_pretrained(target_dir).get_text_config()
    return DSpineConfig.for_target(text, mask_token_id=p.mask_token_id,
                                   **TrainConfig.from_yaml(p.train_config).drafter)


# ----------------------------------------------------------------------------------- building
@pytest.fixture(scope="module", params=list(TARGETS))
def served(request, tmp_path_factory):
    """(published numbers, drafter config, resolved server args, build(): a fresh SGLang draft model
    on meta, the model built once, peak RSS growth in bytes while building it), inside the SGLang
    process state the draft worker would have: the preset's flags resolved and published, a world-1
    gloo group, the rotary CPU stand-in."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.layers.rotary_embedding import factory as rope_factory
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.hf_transformers_utils import get_config

    p = TARGETS[request.param]
    root = tmp_path_factory.mktemp(f"real_{p.preset}")
    target_dir, draft_dir = root / "target", root / "draft"
    target_dir.mkdir()
    draft_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(p.target))
    dc = drafter_config(p, target_dir)
    (draft_dir / "config.json").write_text(json.dumps(hf_config(dc, "bfloat16")))  # a saved drafter's config

    load_plugins()
    command = serving_launch.build_serve_command(
        serving_presets.load_preset(p.preset),
        ["--model-path", str(target_dir), "--speculative-draft-model-path", str(draft_dir), *CPU, *p.cpu_flags],
        launcher=["sglang", "serve"], environ={})
    assert command.errors == []
    ropes_before = set(rope_factory._ROPE_DICT)
    with pytest.MonkeyPatch.context() as mp:
        for name, value in command.env.items():
            mp.setenv(name, value)
        server_args = prepare_server_args(command.args)
        if hasattr(server_args, "resolve_once"):  # >= 0.5.20
            server_args.resolve_once()
        publish_args(server_args)
        with single_process_groups():
            mp.setattr(rotary_base, "_is_cpu", True)
            cls, arch = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
            hf = get_config(str(draft_dir), trust_remote_code=False)
            assert arch == "DSpineDraftModel"

            def build():
                with torch.device("meta"):
                    return cls(config=hf, quant_config=None).eval()

            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            model = build()
            grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            yield p, dc, server_args, build, model, grown
    for key in set(rope_factory._ROPE_DICT) - ropes_before:  # no meta rotary entry outlives this module
        del rope_factory._ROPE_DICT[key]


# -------------------------------------------------------------------------------------- tests
def test_parameter_names_and_shapes(served):
    p, _, _, _, model, _ = served
    want = sglang_shapes(p)
    got = {name: tuple(t.shape) for name, t in model.named_parameters()}
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    assert got == want
    assert model.lm_head is None and getattr(model, "embed_tokens", None) is None  # the target's, by reference


def test_a_saved_reference_checkpoint_maps_onto_every_parameter(served):
    """The reference drafter's tensors (what `save_checkpoint` writes and `check_weights` demands)
    map through `draft_weights` onto SGLang's parameters: every (parameter, shard) exactly once, none
    left over, the q/k/v and gate/up shards adding up to the fused rows; then SGLang's own weight
    loaders take them (strict: a missing or unexpected tensor raises)."""
    p, dc, _, build, _, _ = served
    saved = expected_shapes(dc)  # the reference DSpineDrafter's state dict, built on meta
    assert saved == checkpoint_shapes(p)
    want = sglang_shapes(p)
    shards = defaultdict(list)
    for name, shape in saved.items():
        param, shard = map_weight_name(name)
        assert param in want, f"{name} maps to {param}, which SGLang's model does not have"
        shards[param].append((shard, shape))
    assert set(shards) == set(want)
    for param, got in shards.items():
        assert [s for s, _ in got] == list(expected_shards(param)), param  # each shard once, in order
        rows = sum(shape[0] for _, shape in got)
        assert (rows, *got[0][1][1:]) == want[param], param
    model = build()
    # Meta tensors everywhere except the one-element confidence bias: SGLang's default loader reads a
    # scalar with .item(), which a meta tensor cannot give.
    tensors = ((n, torch.zeros(s) if numel(s) == 1 else torch.empty(s, device="meta")) for n, s in saved.items())
    assert model.load_weights(tensors) == set(want)


def test_parameter_count(served):
    p, _, _, _, model, _ = served
    count = sum(t.numel() for t in model.parameters())
    assert count == parameter_count(p) == sum(numel(s) for s in sglang_shapes(p).values()) == p.drafter_params
    if p.preset == "qwen3.8-27b":
        assert 1.5e9 <= count <= 2.5e9


def test_what_sglang_reads_from_the_checkpoint(served):
    """Captured target layers, block, window, attention and rotary shapes as SGLang resolves them."""
    p, dc, server_args, _, model, _ = served
    from sglang.srt.layers.radix_attention import AttentionType

    from dspine.sglang import compat

    assert dc.target_layer_ids == list(p.target_layer_ids) and all(0 <= i < p.layers for i in p.target_layer_ids)
    assert (dc.hidden_size, dc.vocab_size, dc.num_target_layers) == (p.hidden, p.vocab, p.layers)
    assert model.dspine_config == dc
    assert model.num_context_features == len(p.target_layer_ids) == p.draft_layers
    assert model.draft_config.resolve_target_layer_ids(target_num_layers=p.layers,
                                                       draft_num_layers=p.draft_layers) == list(p.target_layer_ids)
    assert model.block_size == p.block and model.candidate_selector.top_k == p.top_k
    assert compat.server_args_value(server_args, "speculative_num_draft_tokens") == p.block
    assert compat.server_args_value(server_args, "speculative_draft_window_size") == p.window
    assert len(model.layers) == p.draft_layers and len(model.injections) == p.draft_layers
    for layer in model.layers:
        attn = layer.self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (p.heads, p.kv_heads, p.head_dim)
        # Bidirectional, no per-layer window: the window is the compact draft cache's (checked above).
        assert attn.sliding_window_size in (None, -1) and attn.attn.attn_type == AttentionType.ENCODER_ONLY
        assert attn.rotary_emb.base == p.rope_theta
        assert tuple(attn.rotary_emb.cos_sin_cache.shape) == (p.max_positions, p.head_dim)


def test_building_allocates_nothing(served):
    """Every parameter and buffer on meta (the 27B drafter is ~4 GB in bf16); the process's peak
    memory grew by far less than one weight matrix while building."""
    _, _, _, _, model, grown = served
    assert all(t.is_meta for t in model.parameters()) and all(t.is_meta for t in model.buffers())
    assert grown < 64 << 20, f"peak RSS grew by {grown >> 20} MiB while building the draft model"


def test_the_target_head_attaches(served):
    """The target's lm_head [vocab, hidden] (SGLang's own vocab-parallel head, on meta) attaches and
    the transfer table is [vocab, rank]; a head of another width is refused."""
    p, _, _, build, _, _ = served
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead

    from dspine.sglang import compat

    model = build()
    with torch.device("meta"):
        head = ParallelLMHead(p.vocab, p.hidden, params_dtype=torch.bfloat16)
        other = ParallelLMHead(p.vocab, p.hidden // 2, params_dtype=torch.bfloat16)
    model.attach_target_head(head, tp_group=compat.tp_group())
    table = model.transfer_table()
    assert tuple(table.shape) == (p.vocab, p.rank) and table.is_meta
    with pytest.raises(ValueError, match="trained for"):
        build().attach_target_head(other, tp_group=compat.tp_group())


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen3.8-27b"])
def test_the_dummy_serving_folders_are_what_sglang_resolves(shape, tmp_path):
    """`scripts/make_real_shape_dirs.py`'s folders: SGLang resolves each architecture to a model class
    it has, and reads the DFlash twin's captured layers and block as the DSpine drafter's."""
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.utils.hf_transformers_utils import get_config

    from dspine.bench.real_shapes import write_shape

    load_plugins()   # registers DSpineDraftModel
    p = TARGETS[shape]
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    root = write_shape(shape, tok, tmp_path / "out")
    for name in ("target", "dspine", "dflash"):
        arch = json.loads((root / name / "config.json").read_text())["architectures"]
        assert ModelRegistry.resolve_model_cls(arch)[1] == arch[0]
    dflash = parse_dflash_draft_config(draft_hf_config=get_config(str(root / "dflash"), trust_remote_code=False))
    assert dflash.resolve_block_size(default=0) == p.block
    assert dflash.resolve_target_layer_ids(target_num_layers=p.layers, draft_num_layers=p.draft_layers) == list(
        p.target_layer_ids)
