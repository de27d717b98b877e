"""Version shims between SGLang 0.5.17 (the GPU test host) and 0.5.22 (what users install).

Each shim is one small named function, so the difference it papers over is written down once.
Supported: 0.5.17 to 0.5.22. See docs/sglang.md for what differs where.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

from dspine.sglang.rules import RAGGED_VERIFY_ENV


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
        return os.environ.get(RAGGED_VERIFY_ENV, "static")
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
