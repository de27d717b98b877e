"""Version shims between the SGLang versions DSpine is tested with (0.5.17 to 0.5.23).

Each shim is one small named function, so the difference it papers over is written down once.
0.5.23 reads like 0.5.22 wherever a shim names 0.5.22. See docs/sglang.md for what differs where.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from typing import Any

from dspine import env


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def is_foreign_defaults(sa: Any) -> bool:
    """True for the `_ForeignDefaults` stand-in that >= 0.5.20 hands to `handle_server_args`.

    It reads through SGLang's live resolving view and records plain field assignments as
    declarations; 0.5.17 hands the real, in-place-mutated `ServerArgs` instead.
    """
    return type(sa).__name__ == "_ForeignDefaults"


def server_args_value(sa: Any, name: str, default: Any = None) -> Any:
    """The value resolution has decided so far for ServerArgs field `name`.

    >= 0.5.20 keeps raw input in the fields and the decisions in declarations
    (`overrides.resolving_view`); 0.5.17 mutates most fields in place but already declares model
    overrides (`overrides.resolved_view`). The stand-in must be read directly: a view built over it
    would skip the stand-in's own writes.
    """
    return getattr(_reader(sa), name, default)


def _reader(sa: Any) -> Any:
    if is_foreign_defaults(sa):
        return sa
    from sglang.srt.arg_groups import overrides

    view = getattr(overrides, "resolving_view", None) or getattr(overrides, "resolved_view", None)
    return view(sa) if view is not None else sa


def spec_config_value(server_args: Any, name: str, default: Any = None) -> Any:
    """A speculative setting at run time (for the worker): the published `get_spec()` bag when
    there is one (0.5.17 and later publish it), else the resolved server args."""
    try:
        from sglang.srt.runtime_context import get_spec
        return getattr(get_spec(), name)
    except (ImportError, ValueError, AttributeError):
        return server_args_value(server_args, name, default)


def dp_attention_enabled(sa: Any) -> bool:
    """>= 0.5.20: attention-DP width > 1 (`attn_dp_enabled_of`); 0.5.17: `--enable-dp-attention`."""
    try:
        from sglang.srt.runtime_context import attn_dp_enabled_of
    except ImportError:
        return bool(server_args_value(sa, "enable_dp_attention", False))
    return bool(attn_dp_enabled_of(_reader(sa)))


def replayssm_spec_flag(sa: Any) -> tuple[bool, str]:
    """Whether ReplaySSM spec-verify is on, and the flag's name in this version.

    `--enable-linear-replayssm-spec` from 0.5.17 on; 0.5.16 called it `--enable-gdn-replayssm-spec`.
    """
    for field, flag in (("enable_linear_replayssm_spec", "--enable-linear-replayssm-spec"),
                        ("enable_gdn_replayssm_spec", "--enable-gdn-replayssm-spec")):
        value = server_args_value(sa, field, None)
        if value is not None:
            return bool(value), flag
    return False, "--enable-linear-replayssm-spec"


def ragged_verify_mode() -> str:
    """`SGLANG_RAGGED_VERIFY_MODE` as SGLang reads it (same reader in 0.5.17 and 0.5.22)."""
    try:
        from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode
    except ImportError:
        return env.SGLANG_RAGGED_VERIFY_MODE.get()
    return read_ragged_verify_mode().value


def mixed_chunk_allowed_with_spec() -> bool:
    """>= 0.5.20 asks the algorithm (`supports_mixed_chunk`); 0.5.17 asserts mixed chunk is off
    whenever speculative decoding is on, so DSPINE must turn it off there as DFLASH does."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    return hasattr(CustomSpecAlgo, "supports_mixed_chunk")


def build_dflash_disagg_draft_input(args: tuple) -> Any:
    """PD-disaggregated decode's first draft input, as DFLASH builds it (DSPINE's worker is a
    DFlash worker), or None where SGLang has no DFlash builder.

    >= 0.5.18: `(batch, last_tokens_tensor, future_map)` and `dflash_disaggregation`;
    0.5.17: `(batch, server_args, last_tokens_tensor, future_map)` and no DFlash builder.
    """
    try:
        from sglang.srt.speculative.dflash_disaggregation import build_dflash_disagg_draft_input as build
    except ImportError:
        return None
    return build(*args)


# --------------------------------------------------------------------------- worker / draft model
def published_spec_value(name: str, default: Any = None) -> Any:
    """A speculative setting from the published `get_spec()` bag (scheduler processes), or `default`
    where nothing is published (tests, tools)."""
    try:
        from sglang.srt.runtime_context import get_spec
        return getattr(get_spec(), name, default)
    except (ImportError, ValueError, AttributeError):
        return default


def has_selector_seam() -> bool:
    """>= 0.5.20: `DFlashWorkerV2` folds `draft_model.candidate_selector` (`build_lattice`,
    `sample_path`) and `compute_candidates` into the draft graph, has an eager twin
    (`_propose_selector_block`) and verifies sampled paths with their q. 0.5.17 has none of it: the
    DSPINE worker folds the same functions in through `_maybe_build_draft_sampler` instead."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    return hasattr(DFlashWorkerV2, "_propose_selector_block")


def sglang_candidate_topk():
    """`models.dflash.candidate_topk` (>= 0.5.20: radix top-k, TP shard gather, quantized heads),
    or None (0.5.17; DSpine's own `global_topk` is used then)."""
    try:
        from sglang.srt.models.dflash import candidate_topk
    except ImportError:
        return None
    return candidate_topk


def tp_group() -> Any:
    """The TP `GroupCoordinator`: `get_parallel().tp_group` (0.5.22; 0.5.17 has it too), else the
    older `distributed.get_tp_group()`."""
    try:
        from sglang.srt.runtime_context import get_parallel
        return get_parallel().tp_group
    except (ImportError, AttributeError, ValueError, AssertionError):
        from sglang.srt.distributed import get_tp_group
        return get_tp_group()


def decode_graph_max_bs() -> int:
    """Largest captured decode batch (sizes the in-graph sampler's buffers); same reader in 0.5.17
    and 0.5.22."""
    from sglang.srt.runtime_context import get_exec

    return int(max(get_exec().graph.cuda_graph_config.decode.bs))


def eager_draft_sampler_forced() -> bool:
    """`SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1` keeps the draft head out of the graph (both versions)."""
    from sglang.srt.environ import envs

    return bool(envs.SGLANG_DFLASH_EAGER_DRAFT_SAMPLER.get())


def unwrap_lora_layer(layer: Any) -> Any:
    """The base layer under a LoRA wrapper (`lora.layers.unwrap_lora_layer` where it exists)."""
    try:
        from sglang.srt.lora.layers import unwrap_lora_layer as unwrap
    except ImportError:
        return getattr(layer, "base_layer", layer)
    return unwrap(layer) if layer is not None else None


def replayssm_commit_active(target_worker: Any) -> bool:
    """True when the target's mamba pool runs ReplaySSM spec-verify (GDN ring cursors, GDN or KDA
    fold): then only `spec_utils.commit_mamba_states_after_verify` commits correctly (the DFlash
    worker's backend call does not advance the GDN ring). Same pool attributes in 0.5.17 and 0.5.22."""
    pool = getattr(getattr(target_worker.model_runner, "req_to_token_pool", None), "mamba_pool", None)
    return pool is not None and (bool(getattr(pool, "replayssm_spec_fold", False))
                                 or getattr(pool, "replayssm_cache_base", None) is not None)


@functools.lru_cache(maxsize=1)
def dflash_verify_refreshes_mamba_track() -> bool:
    """True where DFlash's own verify preparation rebuilds the GDN track indices from the requests
    (`spec_utils.prepare_mamba_track_for_verify`, called in `dflash_info` from 0.5.20 on); 0.5.17's
    does not, so its spec decode batches keep the prefill's track slot (the radix cache's)."""
    from sglang.srt.speculative import dflash_info

    try:
        return "prepare_mamba_track_for_verify" in inspect.getsource(dflash_info)
    except (OSError, TypeError):  # no source shipped: assume SGLang does it
        return True


def prepare_mamba_track_for_verify(batch: Any) -> None:
    """`spec_utils.prepare_mamba_track_for_verify(batch)` (same signature in 0.5.17 and 0.5.22): a
    no-op unless the mamba extra buffer is on; sets only batch fields."""
    from sglang.srt.speculative import spec_utils

    spec_utils.prepare_mamba_track_for_verify(batch)


def commit_mamba_states_after_verify(target_worker: Any, batch: Any, *, accept_lens: Any, accept_index: Any,
                                     draft_token_num: int) -> None:
    """`spec_utils.commit_mamba_states_after_verify`: positional `(target_worker, batch, accept_lens,
    accept_index, draft_token_num)` in 0.5.17 and 0.5.22 (0.5.22 adds an optional
    `prepared_step_indices`, left to its default). `batch.seq_lens` must still be pre-verify."""
    from sglang.srt.speculative import spec_utils

    spec_utils.commit_mamba_states_after_verify(target_worker, batch, accept_lens, accept_index, draft_token_num)


def request_fill_ids(req: Any) -> Any:
    """A request's tokens so far (prompt, plus output after a retraction): 0.5.17+'s `get_fill_ids()`,
    earlier versions' `fill_ids`."""
    getter = getattr(req, "get_fill_ids", None)
    return getter() if callable(getter) else req.fill_ids


def add_text_qwen3_5_capture(module: Any) -> None:
    """Give 0.5.17's text-only Qwen3.5 hybrid wrapper the target-layer capture seam it lacks.

    `module` is `sglang.srt.models.qwen3_5_text`. Its `Qwen3_5ForCausalLM` (what a text-only
    Qwen3.5/3.6 hybrid checkpoint loads as; the MoE variant subclasses it) wraps a body that captures
    the hidden states entering chosen layers and a forward that hands them to the logits processor,
    but 0.5.17 has no `set_dflash_layers_to_capture` on the wrapper, so SGLang refuses DFLASH-family
    drafters for it at start-up. 0.5.20 and later define it; then this does nothing. The added method
    does what theirs does: target layer i is read at the input of body layer i + 1.
    """
    wrapper = getattr(module, "Qwen3_5ForCausalLM", None)
    if wrapper is None or hasattr(wrapper, "set_dflash_layers_to_capture"):
        return

    def set_dflash_layers_to_capture(self, layer_ids: list[int]) -> None:
        self.capture_aux_hidden_states = True
        self.model.set_dflash_layers_to_capture([layer_id + 1 for layer_id in layer_ids])

    wrapper.set_dflash_layers_to_capture = set_dflash_layers_to_capture
