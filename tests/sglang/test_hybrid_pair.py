"""The hybrid GDN pair of dspine/bench/hybrid_pair.py against SGLang's own code (CPU).

What a GPU run of `dspine/bench/serving.py --model-path OUT/target --draft OUT/drafter --spec-flags
"--enable-linear-replayssm-spec --linear-replayssm-cache-len 32"` would meet first, checked here:
- the script: a missing tokenizer folder is named; the pair is deterministic; tokenizer files copied;
- SGLang's config loading (`ModelConfig`, SGLang's own `Qwen3NextConfig`) reads the target as a
  hybrid GDN model (`hybrid_gdn_config`, `mambaish_config`, layer pattern from
  `full_attention_interval`), its `ModelRegistry` resolves SGLang's `Qwen3NextForCausalLM`, and
  `mamba2_cache_params` sizes the GDN state of the default (GPU) shapes, in fp32 under ReplaySSM;
- the benchmark's DSPINE flags plus `--spec-flags` resolve through SGLang's parser and DSpine's
  rules with ring 32 and are refused with ring 16, and so does `dspine serve --preset qwen3.8-27b`;
- SGLang builds the target on the CPU and its `load_weights` fills every parameter from the file;
- the drafter passes the worker's `check_target_compatible` against SGLang's target config and
  loads strictly into SGLang's DSpine draft model class.
Small shapes (hidden 128, vocab 512) for everything that reads weights; the default shapes
(hidden 1024, vocab 49152) for the config-only checks.
CPU stand-ins, as in test_sglang_draft_model.py: `--device cpu --skip-tokenizer-init` (the host
run's `--disable-radix-cache` leaves overlap scheduling on, on CPU too), a world-1 gloo group with SGLang's model-parallel and DP-attention state, rotary `_is_cpu` patched,
and `torch.get_device_module()` answering `torch.cpu` (the GDN layer asks it for its norm's device).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
from pathlib import Path

import pytest

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from sglang_cpu import publish_args, single_process_groups  # noqa: E402

from dspine.bench import hybrid_pair  # noqa: E402
from dspine.bench import serving as bench_serving  # noqa: E402
from dspine.serve import launch as serving_launch, presets as serving_presets  # noqa: E402
from dspine.model.checkpoint import (  # noqa: E402
    IncompatibleTargetError,
    check_target_compatible,
    read_config,
)
from dspine.sglang import compat  # noqa: E402
from dspine.serve.flags import FlagError  # noqa: E402

VOCAB = 512
SMALL = ["--hidden", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--linear-key-heads", "2",
         "--linear-key-head-dim", "32", "--linear-value-heads", "4", "--linear-value-head-dim", "32",
         "--experts", "4", "--moe-intermediate", "64", "--intermediate", "256"]
CPU = ["--device", "cpu", "--skip-tokenizer-init"]
# What the host run adds to every server (AR and DSPINE alike), see docs/sglang.md: no radix cache, so
# no mamba track slots (DFlash 0.5.17 does not refresh them before verify), fp32 SSM state on both.
HOST_EXTRA = "--cuda-graph-max-bs-decode 16 --mamba-ssm-dtype float32 --disable-radix-cache"
SERVE_SH_BASE = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.4"]
REPLAYSSM = "--enable-linear-replayssm-spec --linear-replayssm-cache-len {}"


def fake_tokenizer_dir(path: Path) -> Path:
    """What the script needs of a tokenizer folder: tokenizer files, chat template, config ids."""
    path.mkdir(parents=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    (path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab},
                                                     "added_tokens": []}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (path / "config.json").write_text(json.dumps({"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
                                                  "pad_token_id": 2}))
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def make_pair():
    return hybrid_pair


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return fake_tokenizer_dir(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def pair(make_pair, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    assert make_pair.main([str(tok_dir), str(out), *SMALL]) == 0
    return out


@pytest.fixture(scope="module")
def default_target(make_pair, tok_dir, tmp_path_factory):
    """config.json only, at the script's default (GPU) shapes with SmolLM2's vocabulary."""
    args = make_pair.parse_args([str(tok_dir), "unused", "--vocab-size", "49152"])
    info = make_pair.tokenizer_info(tok_dir, args.vocab_size)
    path = tmp_path_factory.mktemp("default_target")
    (path / "config.json").write_text(json.dumps(make_pair.target_config(args, info)))
    return path


def resolve(argv: list[str]):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    if hasattr(server_args, "resolve_once"):  # >= 0.5.20
        server_args.resolve_once()
    return server_args


def bench_dspine_flags(target: Path, drafter: Path, cache_len: int) -> list[str]:
    """The DSPINE server's flags exactly as dspine/bench/serving.py builds them for the host run."""
    args = bench_serving.parse_args(["--model-path", str(target), "--draft", str(drafter), "--configs", "AR,DSPINE",
                             "--extra-flags", HOST_EXTRA,
                             "--spec-flags", REPLAYSSM.format(cache_len)])
    configs = bench_serving.server_configs(args)
    assert "--enable-linear-replayssm-spec" not in configs["AR"]
    return configs["DSPINE"]


@pytest.fixture(autouse=True)
def static_verify(monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)


@pytest.fixture(scope="module")
def plugins():
    from sglang.srt.plugins import load_plugins

    load_plugins()


# ------------------------------------------------------------------------------------- the script
def test_a_missing_or_foreign_tokenizer_dir_is_named(make_pair, tmp_path, capsys):
    assert make_pair.main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nowhere is not a directory" in err and "$SMOLLM2" in err
    (tmp_path / "empty").mkdir()
    assert make_pair.main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "holds none of tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_pair_is_complete_and_deterministic(make_pair, tok_dir, pair, tmp_path):
    target, drafter = pair / "target", pair / "drafter"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "model.safetensors"):
        assert (target / name).is_file(), name
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3NextForCausalLM"] and cfg["model_type"] == "qwen3_next"
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert cfg["full_attention_interval"] == 4 and cfg["vocab_size"] == VOCAB and cfg["eos_token_id"] == 2
    dcfg = json.loads((drafter / "config.json").read_text())
    assert dcfg["architectures"] == ["DSpineDraftModel"]
    assert dcfg["dflash_config"] == {"block_size": 16, "target_layer_ids": dcfg["dspine_config"]["target_layer_ids"],
                                     "num_target_layers": 8, "mask_token_id": 16}
    again = tmp_path / "again"
    assert make_pair.main([str(tok_dir), str(again), *SMALL]) == 0
    for sub in ("target", "drafter"):
        assert sha(again / sub / "model.safetensors") == sha(pair / sub / "model.safetensors")
    other = tmp_path / "other"
    assert make_pair.main([str(tok_dir), str(other), *SMALL, "--seed", "1"]) == 0
    assert sha(other / "target" / "model.safetensors") != sha(target / "model.safetensors")


def test_routed_experts_are_tied_so_a_routing_flip_changes_nothing(make_pair, tok_dir, pair, tmp_path):
    """Default: every routed expert of a layer equals expert 0, so re-drawing the router leaves the
    logits as they were (fp32); with --distinct-experts the same re-draw moves them."""
    from transformers import AutoModelForCausalLM

    cfg = json.loads((pair / "target" / "config.json").read_text())
    assert cfg["dspine_random_target"]["tied_experts"] is True
    tensors = read_tensors(pair / "target")
    for i in range(cfg["num_hidden_layers"]):
        for j in range(1, cfg["num_experts"]):
            for n in ("gate_proj", "up_proj", "down_proj"):
                key = f"model.layers.{i}.mlp.experts.{{}}.{n}.weight"
                assert torch.equal(tensors[key.format(j)], tensors[key.format(0)])
    distinct = tmp_path / "distinct"
    assert make_pair.main([str(tok_dir), str(distinct), *SMALL, "--distinct-experts"]) == 0

    def rerouted_change(target: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, VOCAB, (1, 12), generator=g)
        with torch.no_grad():
            before = model(ids).logits
            for layer in model.model.layers:
                layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
            return float((model(ids).logits - before).abs().max())

    assert rerouted_change(pair / "target") < 1e-4
    assert rerouted_change(distinct / "target") > 1e-2


# ---------------------------------------------------------------------------- SGLang's config path
def test_sglang_reads_the_target_as_a_hybrid_gdn_model(pair, default_target):
    from sglang.srt.configs import hybrid_arch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.configs.qwen3_next import Qwen3NextConfig
    from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM
    from sglang.srt.models.registry import ModelRegistry

    for path in (pair / "target", default_target):
        mc = ModelConfig(str(path), trust_remote_code=False)
        hf = mc.hf_config
        assert isinstance(hf, Qwen3NextConfig)  # SGLang's own config class, not transformers'
        want = json.loads((path / "config.json").read_text())["layer_types"]
        assert hf.layers_block_type == ["attention" if t == "full_attention" else t for t in want]
        assert hybrid_arch.hybrid_gdn_config(mc) is hf and hybrid_arch.mambaish_config(mc) is not None
        assert ModelRegistry.resolve_model_cls(hf.architectures)[0] is Qwen3NextForCausalLM


@pytest.mark.parametrize("cache_len", [32, 16])
def test_the_host_benchmark_flags_resolve_with_ring_32_only(plugins, pair, default_target, cache_len):
    """bench_serving's DSPINE flags + --spec-flags (+ serve.sh's base flags), through SGLang's parser
    and resolution with DSPINE's rules; `dspine serve --preset qwen3.8-27b` judges the same way."""
    drafter = pair / "drafter"
    argv = [*SERVE_SH_BASE, *bench_dspine_flags(default_target, drafter, cache_len), *CPU]
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "16"
    command = serving_launch.build_serve_command(
        serving_presets.load_preset("qwen3.8-27b"),
        ["--model-path", str(default_target), "--speculative-draft-model-path", str(drafter),
         "--speculative-num-draft-tokens", "16", "--linear-replayssm-cache-len", str(cache_len)],
        launcher=["sglang", "serve"], environ={})
    if cache_len == 16:
        with pytest.raises(FlagError, match=r"--linear-replayssm-cache-len 16 with --enable-linear-replayssm-spec.*"
                                            r"Fix: --linear-replayssm-cache-len 32"):
            resolve(argv)
        assert len(command.errors) == 1 and "Fix: --linear-replayssm-cache-len 32" in command.errors[0]
        return
    assert command.errors == []
    server_args = resolve(argv)
    view = {name: compat.server_args_value(server_args, name) for name in (
        "speculative_algorithm", "speculative_num_draft_tokens", "enable_linear_replayssm_spec",
        "linear_replayssm_cache_len", "mamba_ssm_dtype", "linear_attn_backend", "max_running_requests",
        "disable_radix_cache", "disable_overlap_schedule")}
    assert view == {"speculative_algorithm": "DSPINE", "speculative_num_draft_tokens": 16,
                    "enable_linear_replayssm_spec": True, "linear_replayssm_cache_len": 32,
                    "mamba_ssm_dtype": "float32", "linear_attn_backend": "triton", "max_running_requests": 48,
                    "disable_radix_cache": True, "disable_overlap_schedule": False}


# ------------------------------------------------------------------ SGLang's model classes on CPU
@pytest.fixture(scope="module")
def sglang_cpu(plugins, pair):
    """Server args for the small pair resolved and published by SGLang, a world-1 gloo group with
    SGLang's model-parallel and DP-attention state, and the CPU stand-ins (module docstring)."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers import dp_attention

    server_args = resolve([*SERVE_SH_BASE, *bench_dspine_flags(pair / "target", pair / "drafter", 32), *CPU])
    publish_args(server_args)
    model_config = ModelConfig.from_server_args(server_args)
    device_module = torch.get_device_module
    with single_process_groups(), pytest.MonkeyPatch.context() as mp:
        if len(inspect.signature(dp_attention.initialize_dp_attention).parameters) == 2:  # 0.5.17
            dp_attention.initialize_dp_attention(server_args, model_config)
        else:
            dp_attention.initialize_dp_attention(server_args)
        mp.setattr(rotary_base, "_is_cpu", True)
        mp.setattr(torch, "get_device_module",
                   lambda device=None: torch.cpu if device is None else device_module(device))
        yield model_config


def test_sglang_sizes_the_gdn_state_of_the_default_shapes(sglang_cpu, default_target):
    """6 linear layers; per layer and request [HV, V, K] = [8, 128, 128] fp32 and a conv window over
    q, k, v (2 x 4 x 128 + 8 x 128 channels)."""
    from sglang.srt.configs.model_config import ModelConfig

    params = ModelConfig(str(default_target), trust_remote_code=False).hf_config.mamba2_cache_params
    assert params.layers == [0, 1, 2, 4, 5, 6]
    assert tuple(params.shape.temporal) == (8, 128, 128) and params.shape.conv_dim == 2 * 4 * 128 + 8 * 128
    assert params.dtype.temporal == torch.float32


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_sglang_builds_the_target_and_loads_every_parameter(sglang_cpu, pair):
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(sglang_cpu.hf_config.architectures)
    model = cls(config=sglang_cpu.hf_config, quant_config=None)
    tensors = read_tensors(pair / "target")
    loaded = model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    assert set(params) - set(loaded) == set()  # SGLang's loader skips unknown names silently: none left unset
    assert torch.equal(params["model.embed_tokens.weight"].to(torch.bfloat16), tensors["model.embed_tokens.weight"])
    assert torch.equal(params["lm_head.weight"].to(torch.bfloat16), tensors["lm_head.weight"])
    assert torch.equal(params["model.layers.0.linear_attn.A_log"].to(torch.bfloat16),
                       tensors["model.layers.0.linear_attn.A_log"])
    qkv = torch.cat([tensors[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params["model.layers.3.qkv_proj.weight"].to(torch.bfloat16), qkv)
    experts = params["model.layers.1.mlp.experts.w2_weight"]  # [E, H, I] down projections
    assert torch.equal(experts[2].to(torch.bfloat16), tensors["model.layers.1.mlp.experts.2.down_proj.weight"])


def test_the_drafter_passes_dspine_checks_against_the_target(sglang_cpu, pair, default_target):
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.utils.hf_transformers_utils import get_config

    cfg = read_config(pair / "drafter")
    hf = sglang_cpu.hf_config
    check_target_compatible(cfg, hf.get_text_config())  # what DSpineWorkerV2.__init__ runs
    with pytest.raises(IncompatibleTargetError, match="vocab_size = 512 but the target has 49152"):
        check_target_compatible(cfg, ModelConfig(str(default_target), trust_remote_code=False).hf_config)
    cls, _ = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
    draft = cls(config=get_config(str(pair / "drafter"), trust_remote_code=False), quant_config=None)
    draft.load_weights(read_tensors(pair / "drafter").items())  # strict: raises on a missing/extra/mis-shaped tensor
    assert draft.dspine_config.target_layer_ids == cfg.target_layer_ids and draft.block_size == 16
