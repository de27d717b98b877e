"""What a hybrid target's recurrent-state pool (SGLang's `MambaPool`) tells the DSPINE worker.

A hybrid target (Gated-DeltaNet linear attention beside full attention) keeps per request a
recurrent state `temporal` [layers, slots, HV, V, K] and conv windows. Under
`--enable-linear-replayssm-spec` SGLang (0.5.17 and 0.5.22 alike) skips the per-token snapshot
buffer `intermediate_ssm` [layers, spec_slots, N, HV, V, K] and keeps a small ring of each
verified token's inputs instead; how the commit uses that ring differs by version:

- fold-every-commit (`pool.replayssm_spec_fold`: every ReplaySSM pool in 0.5.17, KDA in 0.5.22):
  the commit replays the accepted tokens into `temporal`, so after every commit the live state is
  current, exactly as after an AR decode step;
- circular ring (GDN in 0.5.22: cursors `replayssm_cache_base` / `replayssm_is_flush`): committed
  tokens stay in the ring until a periodic flush; `temporal` lags behind by up to the ring length.

- `plain_step_refusal(target_worker)`: why the speculation switch's plain steps (SGLang's AR decode
  path, which reads and advances the live state in place) cannot serve this target, or None;
- `verify_scratch(target_worker, num_draft_tokens)`: per-request verify scratch, ReplaySSM's ring as
  allocated in the server against the per-token snapshots SGLang allocates without it.
"""

from __future__ import annotations

from typing import Any

from dspine import env
from dspine.engine.replay_ssm import ScratchBytes


def _pools(target_worker: Any) -> tuple[Any, Any]:
    """(req_to_token_pool, mamba_pool or None) of the target's model runner."""
    req_pool = getattr(target_worker.model_runner, "req_to_token_pool", None)
    return req_pool, getattr(req_pool, "mamba_pool", None)


def plain_step_refusal(target_worker: Any) -> str | None:
    """None when a plain decode step is exact on this target: no recurrent state, or one that every
    commit leaves current in its live slots with no mid-decode prefix-cache snapshots; else the
    reason and the fix, for a start-up error."""
    req_pool, pool = _pools(target_worker)
    if pool is None:
        return None
    switch = env.DSPINE_DYNAMIC.name
    if getattr(pool, "replayssm_cache_base", None) is not None:
        return (f"{switch}: this SGLang keeps a hybrid target's committed Gated-DeltaNet tokens in the ReplaySSM "
                "ring until a periodic flush (circular-ring mode), so the live state lags the committed one and a "
                "plain decode step would read a stale state. Fix: unset the switch file, or serve without "
                "--enable-linear-replayssm-spec (per-token snapshots), or with SGLang 0.5.17 (fold-every-commit)")
    if getattr(req_pool, "enable_mamba_extra_buffer", False):
        return (f"{switch}: the hybrid target's prefix cache snapshots recurrent states during decoding "
                "(mamba extra_buffer), and the plain step does not prepare those snapshots. Fix: add "
                "--disable-radix-cache, or --mamba-radix-cache-strategy no_buffer with --disable-overlap-schedule, "
                "or unset the switch file")
    return None


def verify_scratch(target_worker: Any, num_draft_tokens: int) -> ScratchBytes | None:
    """Verify scratch per request slot, in bytes, from the pool's live tensors (None: no ReplaySSM ring).

    `replay_records`: the ring tensors as allocated (summed over layers, divided by their slots);
    `snapshot_state`: `intermediate_ssm` of N = `num_draft_tokens` tokens at `temporal`'s shape and
    dtype, what SGLang allocates per request without ReplaySSM; `replay_conv` = `snapshot_conv`:
    the intermediate conv windows, kept by both schemes (physical bytes per slot)."""
    _, pool = _pools(target_worker)
    cache = getattr(pool, "mamba_cache", None)
    rings = [getattr(cache, name, None) for name in
             ("replayssm_d", "replayssm_k", "replayssm_g", "replayssm_rawv", "replayssm_rawk", "replayssm_beta")]
    rings = [t for t in rings if t is not None]
    if not rings:
        return None
    temporal = cache.temporal                          # [layers, slots, HV, V, K]
    layers, per_token = int(temporal.shape[0]), int(temporal[0, 0].numel()) * temporal.element_size()
    ring = sum(t.numel() * t.element_size() // int(t.shape[1]) for t in rings)
    windows = getattr(pool, "_intermediate_conv_window_phys", None) or []
    conv = sum(t.numel() * t.element_size() // int(t.shape[1]) for t in windows)
    return ScratchBytes(snapshot_state=layers * int(num_draft_tokens) * per_token, snapshot_conv=conv,
                        replay_records=ring, replay_conv=conv)
