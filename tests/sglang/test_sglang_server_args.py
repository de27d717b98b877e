"""DSPINE server-args resolution through SGLang's own parser and resolution pipeline (CPU).

Each preset's flags go through `prepare_server_args` + resolution (+ publish / `get_spec()` where the
version has them), with tiny local target configs and a draft directory holding only config.json.
CPU stand-ins (documented per use): `--device cpu --skip-tokenizer-init`, and for the hybrid target
`--disable-overlap-schedule` (CPU has no mamba extra_buffer snapshots, so SGLang's `auto` mamba cache
must fall back to no_buffer, which needs overlap off).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest

# Installed or not is read from package metadata: an import would be fooled by `tests/sglang/`, which
# looks like a namespace package called `sglang`. An installed but broken SGLang fails loudly.
try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from dspine.serve import launch as serving_launch, presets as serving_presets  # noqa: E402
from dspine.sglang import compat, flag_check  # noqa: E402
from dspine.serve.flags import FlagError  # noqa: E402

CPU = ["--device", "cpu", "--skip-tokenizer-init"]
DENSE = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 8, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
HYBRID = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "num_hidden_layers": 8, "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
          "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
          "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_value_head_dim": 16, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
          "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "partial_rotary_factor": 0.25,
          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25},
          "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def write_dir(path: Path, config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def draft_config(block_size: int = 16) -> dict:
    return {**DENSE, "architectures": ["DSpineDraftModel"], "num_hidden_layers": 5,
            "dspine_config": {"block_size": block_size, "target_layer_ids": [1, 2, 3, 4, 5],
                              "num_target_layers": 8, "mask_token_id": 999, "sliding_window": 8192,
                              "transfer_rank": 16}}


@pytest.fixture(scope="module", autouse=True)
def plugins():
    load_plugins()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_args")
    return {"dense": write_dir(root / "dense", DENSE), "hybrid": write_dir(root / "hybrid", HYBRID),
            "draft": write_dir(root / "draft16", draft_config(16)),
            "draft8": write_dir(root / "draft8", draft_config(8))}


@pytest.fixture(autouse=True)
def static_verify(monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)


def resolve(argv: list[str]):
    """SGLang's own path from argv to resolved args: returns (record, view of resolved values)."""
    server_args = prepare_server_args(argv)
    if hasattr(server_args, "resolve_once"):  # >= 0.5.20; 0.5.17 resolves in __post_init__
        server_args.resolve_once()
    return server_args, _View(server_args)


class _View:
    def __init__(self, server_args):
        self.server_args = server_args

    def __getattr__(self, name):
        return compat.server_args_value(self.server_args, name)


def published_spec(server_args):
    from sglang.srt.runtime_context import get_spec, publish

    publish(server_args, role="test")
    return get_spec()


def base(dirs, target="dense", draft="draft", *extra):
    return ["--model-path", dirs[target], "--speculative-algorithm", "dspine",
            "--speculative-draft-model-path", dirs[draft], *CPU, *extra]


# --- each preset's flags, resolved by SGLang -----------------------------------------------------

@pytest.mark.parametrize("preset, target, cpu_only, max_running", [
    ("qwen3-8b", "dense", [], 48),
    ("smollm2-135m", "dense", [], 48),
    ("qwen3.8-27b", "hybrid", ["--disable-overlap-schedule"], 32),
])
def test_preset_flags_resolve(dirs, monkeypatch, preset, target, cpu_only, max_running):
    command = serving_launch.build_serve_command(
        serving_presets.load_preset(preset),
        ["--model-path", dirs[target], "--speculative-draft-model-path", dirs["draft"], *CPU, *cpu_only],
        launcher=["sglang", "serve"], environ={})
    assert command.errors == []
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)
    server_args, view = resolve(command.args)
    assert view.speculative_algorithm == "DSPINE"
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (1, 1, 16)
    assert view.max_running_requests == max_running
    spec = published_spec(server_args)
    assert (spec.speculative_num_steps, spec.speculative_eagle_topk, spec.speculative_num_draft_tokens) == (1, 1, 16)
    assert compat.spec_config_value(server_args, "speculative_num_draft_tokens") == 16  # the worker's reader
    if preset == "qwen3.8-27b":
        assert view.enable_linear_replayssm_spec and view.linear_replayssm_cache_len == 32
        assert view.speculative_draft_window_size == 8192
    # the worker's start-up check: SGLang applied every flag `dspine serve` passed
    effects = flag_check.check_served_flags(server_args, environ=command.flags_env)
    assert len(effects) == len(command.flags) and all(e.applied for e in effects)


def test_defaults_come_from_the_checkpoint(dirs):
    server_args, view = resolve(base(dirs, "dense", "draft8"))
    assert (view.speculative_num_steps, view.speculative_eagle_topk) == (1, 1)
    assert view.speculative_num_draft_tokens == 8  # dspine_config.block_size
    assert view.max_running_requests == 48
    assert published_spec(server_args).speculative_num_draft_tokens == 8


def test_writes_land_where_this_version_keeps_decisions(dirs):
    """>= 0.5.20 hands handle_server_args a stand-in that turns our assignments into declarations
    (raw input untouched); 0.5.17 hands the real ServerArgs, resolved in place."""
    from sglang.srt.arg_groups import overrides

    server_args, _ = resolve(base(dirs))
    ours = {"speculative_draft_window_size": 8192,  # unset: the checkpoint's dspine_config.sliding_window
            "speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 16,
            "max_running_requests": 48}
    if hasattr(overrides, "record_foreign_defaults"):
        declared = [fields for source, fields in server_args._resolved_overrides
                    if source == "handle_speculative_decoding.custom_algo"]
        assert declared == [ours]
        assert server_args.speculative_num_draft_tokens is None
    else:
        assert {name: getattr(server_args, name) for name in ours} == ours


# --- wrong combinations fail during resolution, with the flag named ---------------------------

@pytest.mark.parametrize("extra, message", [
    (["--speculative-num-draft-tokens", "8"], "--speculative-num-draft-tokens 8 differs from the draft "
                                              "checkpoint's block size 16"),
    (["--speculative-draft-window-size", "8"], "--speculative-draft-window-size 8 is smaller than the verify block"),
    (["--speculative-eagle-topk", "4"], "--speculative-eagle-topk 4: DSPINE verifies a single chain"),
    (["--speculative-num-steps", "3"], "--speculative-num-steps 3: DSPINE drafts a whole block"),
    (["--pp-size", "2"], "--pp-size 2: DSPINE (like DFLASH) supports pipeline parallelism 1 only"),
])
def test_wrong_combinations_are_named(dirs, extra, message):
    with pytest.raises(FlagError, match=re.escape(message)) as e:
        resolve(base(dirs, "dense", "draft", *extra))
    assert "Fix:" in str(e.value)


def test_missing_draft_path_is_named(dirs):
    with pytest.raises(FlagError, match="requires --speculative-draft-model-path PATH"):
        resolve(["--model-path", dirs["dense"], "--speculative-algorithm", "dspine", *CPU])


def test_replayssm_ring_too_short_is_named(dirs):
    with pytest.raises(FlagError, match=r"--linear-replayssm-cache-len 16 with "
                                        r"--enable-linear-replayssm-spec.*Fix: --linear-replayssm-cache-len 32"):
        resolve(base(dirs, "hybrid", "draft", "--disable-overlap-schedule", "--enable-linear-replayssm-spec"))


def test_replayssm_ring_not_a_power_of_two_is_named(dirs):
    with pytest.raises(FlagError, match="--linear-replayssm-cache-len 48 with"):
        resolve(base(dirs, "hybrid", "draft", "--disable-overlap-schedule", "--enable-linear-replayssm-spec",
                     "--linear-replayssm-cache-len", "48"))


def test_replayssm_with_a_non_static_verify_mode_is_refused(dirs, monkeypatch):
    """SGLang itself refuses it for any algorithm but DFLASH/DSPARK (before our hook runs); either
    way the message names SGLANG_RAGGED_VERIFY_MODE and static."""
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "cap-accept")
    with pytest.raises(ValueError, match="SGLANG_RAGGED_VERIFY_MODE") as e:
        resolve(base(dirs, "hybrid", "draft", "--disable-overlap-schedule", "--enable-linear-replayssm-spec",
                     "--linear-replayssm-cache-len", "32"))
    assert "static" in str(e.value)


def test_replayssm_resolves_with_a_valid_ring(dirs):
    _, view = resolve(base(dirs, "hybrid", "draft", "--disable-overlap-schedule", "--enable-linear-replayssm-spec",
                           "--linear-replayssm-cache-len", "32"))
    assert view.speculative_num_draft_tokens == 16 and view.mamba_ssm_dtype == "float32"


def test_an_explicit_draft_window_wins_over_the_checkpoint(dirs):
    _, explicit = resolve(base(dirs) + ["--speculative-draft-window-size", "4096"])
    _, unset = resolve(base(dirs))
    assert explicit.speculative_draft_window_size == 4096 and unset.speculative_draft_window_size == 8192


def test_a_flag_the_resolved_server_does_not_hold_stops_the_worker(dirs):
    """The check reads the really resolved server args: told that `dspine serve` passed a
    --max-running-requests the server does not run with, it stops and names the flag and both
    values."""
    command = serving_launch.build_serve_command(
        serving_presets.load_preset("smollm2-135m"),
        ["--model-path", dirs["dense"], "--speculative-draft-model-path", dirs["draft"], *CPU],
        launcher=["sglang", "serve"], environ={})
    server_args, view = resolve(command.args)
    flags = {**command.flags, "--max-running-requests": [str(view.max_running_requests + 16)]}
    env = {"DSPINE_SERVE_FLAGS": json.dumps(flags)}
    with pytest.raises(flag_check.FlagsNotApplied, match=r"--max-running-requests \d+: max_running_requests = "):
        flag_check.check_served_flags(server_args, environ=env)
