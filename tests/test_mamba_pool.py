"""`dspine.sglang.mamba_pool` on stand-ins shaped like SGLang's pools (0.5.17 fold-every-commit, 0.5.22
GDN circular ring): when plain steps are refused, and the verify scratch read from the live tensors."""

from types import SimpleNamespace

import torch

from dspine.sglang.mamba_pool import plain_step_refusal, verify_scratch

LAYERS, SLOTS, HV, HK, V, K, N, CONV_DIM, CONV_K = 3, 5, 4, 2, 8, 8, 16, 48, 4


def worker(pool=None, extra_buffer=False):
    req_pool = SimpleNamespace(mamba_pool=pool, enable_mamba_extra_buffer=extra_buffer)
    return SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=req_pool))


def fold_pool(ring=True):
    """0.5.17 under --enable-linear-replayssm-spec: fp32 temporal, a raw (v, k, g, beta) window of N
    tokens per slot, deduplicated conv windows [layers, slots, dim, N + K - 2]."""
    z = lambda *shape, dtype=torch.bfloat16: torch.zeros(shape, dtype=dtype)  # noqa: E731
    cache = SimpleNamespace(temporal=z(LAYERS, SLOTS, HV, V, K, dtype=torch.float32), replayssm_d=None, replayssm_k=None,
                            replayssm_g=z(LAYERS, SLOTS, HV, N, dtype=torch.float32) if ring else None,
                            replayssm_rawv=z(LAYERS, SLOTS, HV, N, V) if ring else None,
                            replayssm_rawk=z(LAYERS, SLOTS, HK, N, K) if ring else None,
                            replayssm_beta=z(LAYERS, SLOTS, HV, N, dtype=torch.float32) if ring else None)
    return SimpleNamespace(mamba_cache=cache, replayssm_spec_fold=ring, replayssm_cache_base=None,
                           _intermediate_conv_window_phys=[z(LAYERS, SLOTS, CONV_DIM, N + CONV_K - 2)])


def test_plain_steps_are_refused_only_where_the_live_state_can_lag_or_be_snapshotted():
    assert plain_step_refusal(worker()) is None                               # dense target
    assert plain_step_refusal(worker(fold_pool())) is None                    # 0.5.17: every commit folds
    assert plain_step_refusal(worker(fold_pool(ring=False))) is None          # per-token snapshots: scattered
    ring = fold_pool()
    ring.replayssm_spec_fold, ring.replayssm_cache_base = False, torch.zeros(SLOTS, dtype=torch.int32)
    assert "circular-ring mode" in plain_step_refusal(worker(ring))          # 0.5.22 GDN: temporal lags
    refusal = plain_step_refusal(worker(fold_pool(), extra_buffer=True))
    assert "Fix: add --disable-radix-cache" in refusal


def test_verify_scratch_is_read_from_the_allocated_tensors():
    scratch = verify_scratch(worker(fold_pool()), N)
    per_layer_token = HV * V * 2 + HK * K * 2 + HV * 4 + HV * 4              # rawv, rawk (bf16); g, beta (fp32)
    assert scratch.replay_records == LAYERS * N * per_layer_token
    assert scratch.snapshot_state == LAYERS * N * HV * V * K * 4             # intermediate_ssm, fp32, per slot
    assert scratch.replay_conv == scratch.snapshot_conv == LAYERS * CONV_DIM * (N + CONV_K - 2) * 2
    assert scratch.ratio == scratch.snapshot / scratch.replayssm > 1
    assert verify_scratch(worker(fold_pool(ring=False)), N) is None
    assert verify_scratch(worker(), N) is None
