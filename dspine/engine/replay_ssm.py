"""ReplaySSM bookkeeping for the Gated-DeltaNet layers of a hybrid target (engine-independent).

Verification never stores a recurrent state per drafted token. Per request and GDN layer we keep
the checkpoint from before the round (`state`, `conv`) and, for the round being verified, each
fed token's small inputs (`VerifyRecord`). `commit(accept_lens)` replays the accepted tokens into
the checkpoint and rolls the conv window, so that afterwards `state`/`conv` equal what sequential
decoding of the committed tokens would hold. Replaying at every commit (rather than keeping a ring
of records across rounds, as SGLang does) keeps one round of records alive at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dspine.kernels.dispatch import use_triton
from dspine.kernels.gated_delta_replay import gated_delta_replay, gated_delta_replay_reference


@dataclass(slots=True)
class VerifyRecord:
    """Inputs of one verify round of T tokens, for L GDN layers and N requests.

    k: [L, N, T, HV, K] (l2-normalised, expanded to value heads); v: [L, N, T, HV, V];
    g, beta: [L, N, T, HV] fp32; conv_in: [L, N, C, T] pre-conv inputs of the short conv.
    """

    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    conv_in: Tensor


class ReplaySSMState:
    """Recurrent and conv state of L GDN layers for a batch of N requests.

    state: [L, N, HV, K, V] fp32 (transformers/fla convention); conv: [L, N, C, W-1], the last
    W-1 pre-conv inputs (W = conv kernel size, zeros before the first token). `act_dtype` (the
    model's activation dtype) is that of `conv` and of the k, v, conv_in records.
    Invariant between rounds: both equal sequential decoding of every committed token.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_dim: int,
        conv_kernel: int,
        device: torch.device | str | None = None,
        act_dtype: torch.dtype = torch.float32,
    ):
        self.state = torch.zeros(num_layers, batch_size, num_v_heads, head_k_dim, head_v_dim, device=device)
        self.conv = torch.zeros(num_layers, batch_size, conv_dim, conv_kernel - 1, dtype=act_dtype, device=device)
        self.act_dtype = act_dtype
        self.record: VerifyRecord | None = None

    def begin(self, num_tokens: int) -> None:
        """Allocate the records of a verify round of `num_tokens` tokens (replaces any earlier round)."""
        L, N, HV, K, V = self.state.shape
        T, dev = num_tokens, self.state.device
        self.record = VerifyRecord(
            k=torch.empty(L, N, T, HV, K, dtype=self.act_dtype, device=dev),
            v=torch.empty(L, N, T, HV, V, dtype=self.act_dtype, device=dev),
            g=torch.empty(L, N, T, HV, device=dev),
            beta=torch.empty(L, N, T, HV, device=dev),
            conv_in=torch.empty(L, N, self.conv.shape[2], T, dtype=self.conv.dtype, device=dev),
        )

    def record_layer(self, layer: int, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, conv_in: Tensor) -> None:
        """Store one layer's round inputs. k: [N, T, HV, K]; v: [N, T, HV, V]; g, beta: [N, T, HV];
        conv_in: [N, C, T]."""
        rec = self.record
        rec.k[layer], rec.v[layer], rec.g[layer], rec.beta[layer] = k, v, g, beta
        rec.conv_in[layer] = conv_in

    def commit(self, accept_lens: Tensor) -> None:
        """Keep the first accept_lens[n] (0..T) recorded tokens of request n; drops the records.

        Replays them into `state` in place (Triton per `dispatch.use_triton`) and rolls `conv`.
        """
        rec, self.record = self.record, None
        L, N, HV, K, V = self.state.shape
        T = rec.k.shape[2]
        a = accept_lens.to(self.state.device)
        flat = (  # every (layer, request) pair is one replay row
            self.state.view(L * N, HV, K, V),
            rec.k.view(L * N, T, HV, K),
            rec.v.view(L * N, T, HV, V),
            rec.g.view(L * N, T, HV),
            rec.beta.view(L * N, T, HV),
            a.repeat(L),
        )
        if use_triton(self.state):
            gated_delta_replay(*flat, out=flat[0])
        else:
            flat[0].copy_(gated_delta_replay_reference(*flat))
        window = torch.cat([self.conv, rec.conv_in], dim=-1)  # [L, N, C, W-1+T]
        w = self.conv.shape[-1]
        idx = a.view(1, N, 1, 1) + torch.arange(w, device=a.device)  # [1, N, 1, W-1]
        self.conv = window.gather(-1, idx.expand(L, N, window.shape[2], w))

    def select(self, rows: Tensor) -> None:
        """Keep only these requests (between rounds). rows: [N'] indices into the batch."""
        assert self.record is None, "select between rounds, after commit"
        self.state = self.state[:, rows].contiguous()
        self.conv = self.conv[:, rows].contiguous()


@dataclass(frozen=True, slots=True)
class ScratchBytes:
    """Verify scratch of one request, in bytes: per-token snapshots vs ReplaySSM records."""

    snapshot_state: int  # L x T x HV x K x V x state_bytes
    snapshot_conv: int  # L x T x C x (W-1) x conv_bytes (a conv window per token)
    replay_records: int  # L x T x HV x ((K + V) x record_bytes + 2 x 4)  (k, v; g, beta fp32)
    replay_conv: int  # L x T x C x conv_bytes (the fed pre-conv inputs)

    @property
    def snapshot(self) -> int:
        return self.snapshot_state + self.snapshot_conv

    @property
    def replayssm(self) -> int:
        return self.replay_records + self.replay_conv

    @property
    def ratio(self) -> float:
        return self.snapshot / self.replayssm


def verify_scratch_bytes(
    *,
    num_layers: int,
    num_tokens: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_dim: int,
    conv_kernel: int,
    state_bytes: int = 4,
    record_bytes: int = 2,
    conv_bytes: int = 2,
) -> ScratchBytes:
    """Verify scratch per request for `num_layers` GDN layers and `num_tokens` verified tokens."""
    lt = num_layers * num_tokens
    return ScratchBytes(
        snapshot_state=lt * num_v_heads * head_k_dim * head_v_dim * state_bytes,
        snapshot_conv=lt * conv_dim * (conv_kernel - 1) * conv_bytes,
        replay_records=lt * num_v_heads * ((head_k_dim + head_v_dim) * record_bytes + 2 * 4),
        replay_conv=lt * conv_dim * conv_bytes,
    )
