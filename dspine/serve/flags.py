"""The flag rules of a DSPINE server, as plain functions (no SGLang import).

Two callers apply the same rules at two moments:
- `dspine serve` (`dspine.serve.presets.validate_flags`) before it launches anything, so a bad
  combination fails in a second with the flag named, not minutes into a server start;
- the plugin's `DSpineSpecAlgo.handle_server_args` inside SGLang's own resolution, for users who
  launch `sglang serve` directly (and the DSPINE worker, for the switch file).

The decode-step policy is the switch file `DSPINE_DYNAMIC` names (`dspine.dynamic.switch`): none
(static speculation), the dynamic switch, or a forced one; `resolve_step_switch` loads it.

Every check raises `FlagError`, whose message names the flag, the value and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dspine import env

if TYPE_CHECKING:  # the switch's tables import torch; `dspine serve --help` must not
    from dspine.dynamic.switch import ForcedSwitch, SwitchConfig

ALGORITHM = "DSPINE"
DEFAULT_BLOCK_SIZE = 16  # anchor + 15 proposals: SGLang's `--speculative-num-draft-tokens 16`
DEFAULT_MAX_RUNNING_REQUESTS = 48  # what SGLang's DFLASH picks; DSPINE sets it explicitly
DEFAULT_REPLAYSSM_CACHE_LEN = 16  # SGLang's default `--linear-replayssm-cache-len`
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"
# `/server_info` `internal_states[*]` key under which a DSPINE worker reports its decode-step clock
# (`dspine.sglang.step_clock` writes it, `dspine tune-sps` reads it): {kind: {batch size: [steps, seconds]}}
STEP_TIME_STATE_KEY = "dspine_step_time_dict"


class FlagError(ValueError):
    """A server flag (or flag combination) DSPINE cannot serve; the message says how to fix it."""


def read_draft_block_size(draft_path: str | Path | None) -> tuple[int | None, str]:
    """The block size a local draft checkpoint was trained for, and where it was read.

    Looks in `config.json` for `dspine_config.block_size`, then `dflash_config.block_size`, then a
    top-level `block_size`. Returns `(None, reason)` when the path is not a local directory with a
    config (e.g. a hub id: SGLang resolves it later) or the config names no block size.
    """
    if draft_path is None:
        return None, "no draft path"
    config_path = Path(draft_path) / "config.json"
    if not config_path.is_file():
        return None, f"{config_path} not found (not a local checkpoint directory)"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FlagError(f"--speculative-draft-model-path {draft_path}: cannot read {config_path}: {e}. "
                        "Fix: point the flag at a DSpine checkpoint directory with a valid config.json.")
    for where in ("dspine_config", "dflash_config"):
        block = (config.get(where) or {}).get("block_size")
        if block is not None:
            return _block_size(block, f"{config_path} {where}.block_size"), f"{config_path} {where}.block_size"
    if config.get("block_size") is not None:
        return _block_size(config["block_size"], f"{config_path} block_size"), f"{config_path} block_size"
    return None, f"{config_path} has no dspine_config.block_size"


def _block_size(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise FlagError(f"{where} = {value!r}: a block size must be an integer >= 2 (anchor + proposals). "
                        "Fix: repair the draft checkpoint's config.json.")
    return value


def resolve_num_draft_tokens(requested: int | None, dflash_block_size: int | None,
                             checkpoint_block: int | None, checkpoint_source: str = "") -> int:
    """The verify width N (`--speculative-num-draft-tokens`): the checkpoint's block size by default.

    A different explicit value is an error: the drafter was trained for one block size and would
    silently lose acceptance at another.
    """
    if requested is not None and dflash_block_size is not None and int(requested) != int(dflash_block_size):
        raise FlagError(f"--speculative-num-draft-tokens {requested} and --speculative-dflash-block-size "
                        f"{dflash_block_size} differ. Fix: drop --speculative-dflash-block-size "
                        "(DSPINE reads the block size from --speculative-num-draft-tokens or the checkpoint).")
    if requested is None:
        requested = dflash_block_size
    if requested is not None:
        requested = int(requested)
        if requested < 2:
            raise FlagError(f"--speculative-num-draft-tokens {requested}: DSPINE needs >= 2 "
                            "(one anchor plus at least one proposal). Fix: drop the flag.")
        if checkpoint_block is not None and requested != checkpoint_block:
            raise FlagError(
                f"--speculative-num-draft-tokens {requested} differs from the draft checkpoint's block size "
                f"{checkpoint_block} ({checkpoint_source}). The drafter proposes exactly block_size - 1 "
                f"tokens per round. Fix: drop the flag (DSPINE reads it from the checkpoint) or set it "
                f"to {checkpoint_block}.")
        return requested
    return checkpoint_block if checkpoint_block is not None else DEFAULT_BLOCK_SIZE


def check_single_chain(num_steps: int | None, eagle_topk: int | None) -> None:
    """DSPINE drafts one block in one forward: EAGLE's step count and tree width do not apply."""
    if num_steps is not None and int(num_steps) != 1:
        raise FlagError(f"--speculative-num-steps {num_steps}: DSPINE drafts a whole block in one forward "
                        "(num_steps is always 1). Fix: drop the flag.")
    if eagle_topk is not None and int(eagle_topk) != 1:
        raise FlagError(f"--speculative-eagle-topk {eagle_topk}: DSPINE verifies a single chain, not a tree "
                        "(topk is always 1). Fix: drop the flag.")


def check_parallelism(pp_size: int | None, dp_attention: bool) -> None:
    """The DFlash-family worker DSPINE builds on runs with pp_size 1 and without DP attention."""
    if pp_size is not None and int(pp_size) > 1:
        raise FlagError(f"--pp-size {pp_size}: DSPINE (like DFLASH) supports pipeline parallelism 1 only. "
                        "Fix: drop --pp-size and use --tp-size to spread the target.")
    if dp_attention:
        raise FlagError("--enable-dp-attention: DSPINE (like DFLASH on CUDA) does not support DP attention. "
                        "Fix: drop --enable-dp-attention (use --dp-size for data-parallel replicas).")


def check_draft_window(window: int | None, num_draft_tokens: int) -> None:
    """`--speculative-draft-window-size` must hold a whole block (SGLang checks this for DFLASH only)."""
    if window is None:
        return
    if int(window) < num_draft_tokens:
        raise FlagError(f"--speculative-draft-window-size {window} is smaller than the verify block "
                        f"(--speculative-num-draft-tokens {num_draft_tokens}): the draft could not see its own "
                        f"block. Fix: set it to >= {num_draft_tokens} (the 27B preset uses 8192), or drop it.")


def check_replayssm(enabled: bool, cache_len: int | None, num_draft_tokens: int, verify_mode: str | None,
                    flag: str = "--enable-linear-replayssm-spec") -> None:
    """ReplaySSM spec-verify: ring length L >= 2 x verify width and a power of two; static verify only.

    SGLang enforces the ring rule for KDA only and rejects non-static verify only by algorithm name
    (DFLASH / DSPARK), so a DSPINE server would otherwise fail late or run a ring too short to flush.
    """
    if not enabled:
        return
    length = DEFAULT_REPLAYSSM_CACHE_LEN if cache_len is None else int(cache_len)
    need = 2 * num_draft_tokens
    if length < need or length & (length - 1):
        shown = f"--linear-replayssm-cache-len {length}" + (" (the default)" if cache_len is None else "")
        fix = 1 << (need - 1).bit_length()
        raise FlagError(f"{shown} with {flag}: the ring must be a power of two >= 2 x the verify width "
                        f"(2 x {num_draft_tokens} = {need}). Fix: --linear-replayssm-cache-len {fix}.")
    mode = (verify_mode or "static").strip().lower()
    if mode != "static":
        raise FlagError(f"{RAGGED_VERIFY_ENV}={verify_mode} with {flag}: ReplaySSM's GDN ring kernels take "
                        f"static verify windows only, and SGLang allows other modes for DFLASH/DSPARK only. "
                        f"Fix: unset {RAGGED_VERIFY_ENV} or set it to static.")


def resolve_step_switch(environ: Mapping[str, str] | None = None) -> SwitchConfig | ForcedSwitch | None:
    """The switch file a DSPINE server's environment names (`DSPINE_DYNAMIC`), loaded and validated:
    None (static speculation) when unset, else the dynamic switch or a forced one (`.policy`:
    "dynamic", "plain" or "draft"; `.plain_tokens`: target tokens per plain step, None when none runs)."""
    path = env.DSPINE_DYNAMIC.get(environ)
    if path is None:
        return None
    if not path.is_file():
        raise FlagError(f"{env.DSPINE_DYNAMIC.name}={path}: no such file. Fix: point it at the switch.json that "
                        "`dspine tune-sps --plain-table ...` wrote, or at a forced switch file "
                        '({"force": "plain", "plain_tokens": K} or {"force": "draft"})')
    from dspine.dynamic.switch import SwitchConfigError, load_switch

    try:
        return load_switch(path)
    except SwitchConfigError as err:
        raise FlagError(f"{env.DSPINE_DYNAMIC.name}: {err}") from None


def check_switch_target(policy: str, hybrid: bool, prefix_snapshots: bool) -> None:
    """The speculation switch's plain steps run SGLang's AR decode path, which advances a hybrid
    target's recurrent state in place and prepares none of the prefix cache's mid-decode state
    snapshots: with a hybrid target (`hybrid`: --enable-linear-replayssm-spec given) they need a
    prefix cache that takes none (`prefix_snapshots` False: --mamba-radix-cache-strategy no_buffer or
    --disable-radix-cache). The worker checks the live pool at start-up too
    (`dspine.sglang.mamba_pool.plain_step_refusal`). `policy`: "static", "dynamic", "plain" or "draft"."""
    if policy in ("dynamic", "plain") and hybrid and prefix_snapshots:
        raise FlagError(f"{env.DSPINE_DYNAMIC.name} ({policy} switch) with a hybrid target: the prefix cache may "
                        "snapshot recurrent states during decoding (--mamba-radix-cache-strategy auto or "
                        "extra_buffer), which the plain step does not prepare. Fix: add --disable-radix-cache (overlap "
                        "scheduling stays on), or --mamba-radix-cache-strategy no_buffer with "
                        "--disable-overlap-schedule (SGLang's no_buffer needs it), or unset the switch file")


def check_plain_tokens(switch: SwitchConfig | ForcedSwitch | None, num_draft_tokens: int) -> None:
    """A plain step of K tokens per request fits SGLang's one block of KV slots per request and step:
    K <= --speculative-num-draft-tokens."""
    tokens = None if switch is None else switch.plain_tokens
    if tokens is not None and tokens > num_draft_tokens:
        raise FlagError(f"{env.DSPINE_DYNAMIC.name}: the switch file's plain_tokens={tokens} exceeds "
                        f"--speculative-num-draft-tokens {num_draft_tokens}: SGLang reserves one block of KV slots "
                        f"per request and step. Fix: a switch file with plain_tokens {num_draft_tokens} or less")
