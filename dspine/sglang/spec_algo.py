"""`DSpineSpecAlgo`: how SGLang sees a speculative algorithm called DSPINE.

DSPINE is a DFlash-family algorithm: one draft forward over a block of `N` positions (anchor +
N-1 proposals) run as TARGET_VERIFY on the target's captured hidden states, then one target verify
of the same `N` tokens. So it answers SGLang's capability predicates as DFLASH does, while every
identity predicate (`is_dflash`, `is_dspark`, `is_eagle`, ...) stays False so no DFLASH-only or
DSPARK-only branch runs on our worker.

`CustomSpecAlgo` (0.5.16 to 0.5.22) lacks three methods the scheduler calls on every algorithm:
`carries_draft_hidden_states`, `create_future_map`, `need_topk`. They are defined here.

Server args: `handle_server_args` is `_handle_dflash` for DSPINE, written to only *assign* fields
(0.5.17 passes the real ServerArgs; >= 0.5.20 passes a stand-in that turns assignments into
declarations), plus the checks SGLang skips for non-DFLASH names. An unset
`--speculative-draft-window-size` takes the checkpoint's trained window (`dspine_config.sliding_window`),
so the draft sees the context it was trained with. Imported only by
`dspine.sglang.plugin.register()`, inside an SGLang process.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from dspine.sglang import compat
from dspine.serve.flags import (
    ALGORITHM,
    DEFAULT_MAX_RUNNING_REQUESTS,
    FlagError,
    check_draft_window,
    check_parallelism,
    check_replayssm,
    check_single_chain,
    read_draft_block_size,
    resolve_num_draft_tokens,
)

logger = logging.getLogger(__name__)
_windows_logged: set[str] = set()   # draft paths whose window was taken from the checkpoint (logged once)


def _answers(value: bool):
    """A capability predicate that always returns `value`."""

    def predicate(self) -> bool:
        return value

    return predicate


class DSpineSpecAlgo(CustomSpecAlgo):
    """DSPINE's `spec_class` (see SGLANG.md §2 for what each predicate switches on in SGLang)."""

    # Identity: DSPINE is none of the built-ins, so no DFLASH-only or DSPARK-only branch runs.
    is_dflash = is_dspark = is_eagle = _answers(False)
    # Capabilities of the DFlash family: target aux-hidden capture, draft KV budgeting, DFlash
    # decode prep and graph capture; the draft runner captures its graphs in TARGET_VERIFY mode.
    is_dflash_family = supports_target_verify_for_draft = has_draft_kv = _answers(True)
    supports_mixed_chunk = _answers(True)         # 0.5.20+ asks; 0.5.17 never does
    supports_grammar_overlap = _answers(True)     # 0.5.18+: the DFlash worker threads the barrier
    # 0.5.22, only with the WAR read-done env: the draft model's shared-buffer reads are not audited.
    supports_prefill_shared_read_done = _answers(False)
    supports_ragged_verify = _answers(False)      # static verify only

    # --- the three methods CustomSpecAlgo lacks ----------------------------------------------
    def carries_draft_hidden_states(self) -> bool:
        # Scheduler.init_disaggregation: only EAGLE ships draft hidden states prefill -> decode.
        return False

    def need_topk(self) -> bool:
        # FutureMap: no EAGLE top-k relay buffers.
        return False

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        # Scheduler.init_overlap; the built-in implementation works for any algorithm object.
        return SpeculativeAlgorithm.create_future_map(
            self, device, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def build_disagg_draft_input(self, *args):
        # Signature differs by version (0.5.17 passes server_args too): take *args.
        return compat.build_dflash_disagg_draft_input(args)

    # --- server args --------------------------------------------------------------------------
    def handle_server_args(self, server_args: Any) -> None:
        resolve_server_args(server_args)


def resolve_server_args(sa: Any) -> None:
    """DSPINE's share of server-args resolution. Reads through `compat.server_args_value`,
    writes by plain assignment only, raises `FlagError` naming the flag and the fix."""

    def get(name: str, default: Any = None) -> Any:
        return compat.server_args_value(sa, name, default)

    draft_path = get("speculative_draft_model_path")
    if draft_path is None:
        raise FlagError(f"--speculative-algorithm {ALGORITHM} requires --speculative-draft-model-path PATH "
                        "(a DSpine checkpoint directory or hub id). Fix: add the flag, or launch with "
                        "`dspine serve --preset NAME`, which fills it from the preset.")
    check_parallelism(get("pp_size", 1), compat.dp_attention_enabled(sa))
    check_single_chain(get("speculative_num_steps"), get("speculative_eagle_topk"))

    block, source, trained_window = _draft_block_and_window(get, draft_path)
    num_draft_tokens = resolve_num_draft_tokens(
        get("speculative_num_draft_tokens"), get("speculative_dflash_block_size"), block, source)

    window = get("speculative_draft_window_size")
    if window is None and trained_window is not None:
        window = sa.speculative_draft_window_size = trained_window
        if draft_path not in _windows_logged:
            _windows_logged.add(draft_path)
            logger.info("DSPINE: --speculative-draft-window-size %d from the draft checkpoint (the context window "
                        "it was trained with).", window)
    check_draft_window(window, num_draft_tokens)
    replayssm_on, replayssm_flag = compat.replayssm_spec_flag(sa)
    check_replayssm(replayssm_on, get("linear_replayssm_cache_len"), num_draft_tokens,
                    compat.ragged_verify_mode() if replayssm_on else None, replayssm_flag)

    sa.speculative_num_steps = 1
    sa.speculative_eagle_topk = 1
    sa.speculative_num_draft_tokens = num_draft_tokens
    if get("max_running_requests") is None:
        sa.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
        logger.info("DSPINE: --max-running-requests not set, using %d (as DFLASH does).",
                    DEFAULT_MAX_RUNNING_REQUESTS)
    if get("enable_mixed_chunk", False) and not compat.mixed_chunk_allowed_with_spec():
        sa.enable_mixed_chunk = False
        logger.warning("DSPINE: --enable-mixed-chunk turned off: this SGLang version allows no mixed "
                       "chunked prefill with speculative decoding.")
    logger.info("DSPINE: verify width %d (%s)%s.", num_draft_tokens, source or "default",
                f", draft window {window} tokens" if window is not None else "")


def _draft_block_and_window(get, draft_path: str) -> tuple[int | None, str, int | None]:
    """The checkpoint's block size (with where it was read) and trained context window: from a
    local `config.json`, else through SGLang's own config loader for hub ids (as `_handle_dflash`
    does). Unknown block -> (None, reason), default 16 later; unknown window -> None (unset)."""
    block, source = read_draft_block_size(draft_path)
    config_file = Path(draft_path) / "config.json"
    if Path(draft_path).exists():
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        return block, source, trained_window(config.get("dspine_config"), config)
    try:
        from sglang.srt.utils.hf_transformers_utils import get_config

        config = get_config(draft_path, trust_remote_code=bool(get("trust_remote_code", False)),
                            revision=get("speculative_draft_model_revision"))
    except Exception as e:  # same policy as DFLASH: warn, fall back to the default
        logger.warning("DSPINE: could not read the draft config of %s (%s); assuming block size 16.",
                       draft_path, e)
        return None, f"default (draft config unreadable: {e})", None
    window = trained_window(getattr(config, "dspine_config", None), config.to_dict())
    for where in ("dspine_config", "dflash_config"):
        value = (getattr(config, where, None) or {}).get("block_size")
        if value is not None:
            return int(value), f"{draft_path} {where}.block_size", window
    return None, f"{draft_path} has no dspine_config.block_size", window


def trained_window(dspine_config: dict | None, config: dict) -> int | None:
    """The context window a drafter was trained with: `dspine_config.sliding_window`, else the
    top-level `sliding_window` where `layer_types` or `use_sliding_window` says it applies."""
    window = (dspine_config or {}).get("sliding_window")
    if window is None and ("sliding_attention" in (config.get("layer_types") or ())
                           or config.get("use_sliding_window")):
        window = config.get("sliding_window")
    return int(window) if window is not None else None
