"""`DSpineWorkerV2`: SGLang's `DFlashWorkerV2` with DSpine's token choice and commit fixes.

The draft forward itself is the draft model class's (`draft_model.py`: mask embedding, adjacent
injection); this worker only overrides the smallest seams around it:

- `__init__(*args, **kwargs)` (0.5.17 passes `ps`, 0.5.22 does not): after SGLang built the draft
  runner, check the drafter against the target's config (vocab, hidden size, layer count and ids,
  mask id: fails before serving, naming the field) and attach the TARGET's `lm_head` to the draft
  model (transfer table U, candidates) before any graph is captured (`init_cuda_graphs` runs later).
- `forward_batch_generation`: first `draft_model.ensure_transfer_table(serving=True)` (host-side
  check; rebuilds U outside any graph on the first step, when target weights are final, and when
  the head changed), then SGLang's method unchanged.
- Token choice. SGLang >= 0.5.20 (`compat.has_selector_seam()`): nothing to override; the model's
  `candidate_selector`/`compute_candidates` go through DFlash's selector path (in graph, eager, and
  lossless sampled verification with the proposal q). SGLang 0.5.17 has no seam, so:
  `_maybe_build_draft_sampler` folds `DSpineDraftSampler` into the draft graph (capture hook
  `sampler(hidden_states, input_ids)`, writes `.out`), and `_greedy_sample_from_vocab_parallel_head`
  (the eager fallback; it gets only the hidden rows) reads the anchors from
  `_draft_block_ids_buf[:bs, 0]`. On 0.5.17 DSpine proposes the Viterbi path for every row: 0.5.17
  verifies T > 0 by "accept iff the draft equals the target's own sample"
  (`compute_dflash_sampling_correct_drafts_and_bonus`), which is lossless for any proposal and never
  reads q, and whose acceptance is highest for the most likely path.
  With `selection="argmax"` (the ablation) the model has no selector and SGLang's own argmax head
  runs in every version.
- Confidence record (`DSPINE_RECORD_CONFIDENCE=1` in the server's environment; off by default):
  the draft model writes its confidence logits next to the candidates (in the draft graph); after
  each verify step the worker hands them, with the accepted-draft counts, to SGLang's
  `customized_info` channel, so every `/generate` response carries
  `meta_info.dspine_confidence_logits [steps][N-1]` and `meta_info.dspine_accept_lens [steps]`,
  the input of `dspine tune-sps`'s per-position calibration. The device-to-host copies ride on the
  step's stream (no host sync in the worker); the rows are read when SGLang processes the result.
- Speculation switch (`dspine.dynamic.switch`; off by default): with `DSPINE_DYNAMIC=switch.json`
  in the server's environment, before every decode step the host decides (no device sync) whether
  the batch drafts or takes a plain step (`plain_step.PlainStep`: K tokens per request through the
  target's AR decode graphs and sampler, K = the switch file's `plain_tokens`, the drafter's KV still
  appended). The drafter's confidence logits of each drafted step are copied to the host on the
  step's stream and handed to the switch once an event says they landed (no sync), updating each
  request's expected acceptance. A forced switch file (`{"force": "plain", "plain_tokens": K}` or
  `{"force": "draft"}`) makes every step one kind (K-token plain steps: to measure the plain-step table). Not with
  grammar-constrained batches (they draft); hybrid targets only where the target's pool allows it
  (`mamba_pool.plain_step_refusal`, checked at start).
- Copy candidates (`dspine_config.copy_candidates`): a `SlotTokenHistory` keeps
  every request's tokens on the device, written at prefill (the last window of the prompt, one
  host-to-device copy per prefill batch) and after every decode step (the committed tokens, on the
  step's stream); before a step its rows and lengths are pointed at the batch for the draft graph.
- Start-up warm-up (`dspine.sglang.warmup`): after the graphs, every sampling kernel SGLang would
  otherwise compile on first use (flashinfer's sampling module) runs once, so no request pays it.
- Step clock (`dspine.sglang.step_clock`; with `SGLANG_RECORD_STEP_TIME=1`): the host time of each
  call, so the period of consecutive decode steps is booked per kind (draft, plain) and batch size,
  prefills excluded; `/server_info` carries the totals for `dspine tune-sps`.
- GDN track slots (0.5.17, ReplaySSM targets): before a verify step, rebuild the batch's track
  indices from its requests (`spec_utils.prepare_mamba_track_for_verify`), which 0.5.17's DFlash
  verify omits (0.5.20+ does it itself); otherwise the commit below writes into the radix cache's slot.
- `_update_target_mamba_state_after_verify`: on ReplaySSM targets route the commit through
  `spec_utils.commit_mamba_states_after_verify` (advances the GDN ring cursors, which the DFlash
  worker's backend call does not); otherwise DFlash's own commit.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Optional

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from torch import Tensor

from dspine import env
from dspine.model.checkpoint import check_target_compatible
from dspine.dynamic.switch import ServingSwitch, SwitchConfig
from dspine.sglang import compat, step_clock
from dspine.sglang.draft_model import DSpineDraftModel
from dspine.sglang.flag_check import check_running_cap, check_served_flags
from dspine.sglang import mamba_pool
from dspine.sglang.plain_step import PlainStep, tag_verify_tokens
from dspine.sglang.round_graph import RoundGraphs, build_round_graphs, has_penalties
from dspine.sglang.token_history import SlotTokenHistory
from dspine.sglang.warmup import warm_sampling_kernels
from dspine.serve.flags import FlagError, resolve_step_switch

logger = logging.getLogger(__name__)

RECORD_CONFIDENCE_ENV = env.DSPINE_RECORD_CONFIDENCE.name
MAX_PENDING_CONFIDENCE = 4    # drafted steps whose confidence copies may be in flight at once
SWITCH_LOG_EVERY = 5000       # decode steps between the switch's summary lines


class HostRows:
    """Per-request rows of a device-to-host copy, for SGLang's `customized_info` (which takes
    `value[i]` per request and calls its `.copy()` once the step's result is processed): each row
    becomes a plain list (JSON in `meta_info`) only then, after `done` (the copy) has completed."""

    def __init__(self, host: Tensor, done: Optional["torch.cuda.Event"]) -> None:
        self.host, self.done = host, done

    def __len__(self) -> int:
        return int(self.host.shape[0])

    def __getitem__(self, i: int) -> "_HostRow":
        return _HostRow(self, int(i))


class _HostRow:
    def __init__(self, rows: HostRows, i: int) -> None:
        self.rows, self.i = rows, i

    def copy(self):
        if self.rows.done is not None:
            self.rows.done.synchronize()
        return self.rows.host[self.i].tolist()


def confidence_to_host(draft_model: DSpineDraftModel, blocks: int,
                       *extra: Tensor) -> Optional[tuple[list[Tensor], Optional["torch.cuda.Event"]]]:
    """The drafter's last recorded confidence logits [blocks, N-1], then `extra`, copied to the host
    on the current stream without a host sync; the event (None for CPU tensors) completes when the
    copies have landed. None when nothing is recorded (recording off, or more blocks than the buffer)."""
    confidence = draft_model.recorded_confidence(blocks)
    if confidence is None:
        return None
    hosts = [t.to("cpu", non_blocking=True) for t in (confidence, *extra)]
    done = None
    if confidence.is_cuda:
        done = torch.cuda.Event()
        done.record()
    return hosts, done


def attach_confidence_record(result, draft_model: DSpineDraftModel) -> bool:
    """Put the step's confidence logits [bs, N-1] and accepted-draft counts [bs] (SGLang's
    `accept_lens` are commit lengths: accepted + 1) into `result.logits_output.customized_info`.
    False (nothing attached) for results without a verify (prefill, idle) or without a record."""
    commit = getattr(result, "accept_lens", None)
    logits_output = getattr(result, "logits_output", None)
    if commit is None or logits_output is None or commit.numel() == 0:
        return False
    copied = confidence_to_host(draft_model, int(commit.shape[0]), commit.to(torch.int64) - 1)
    if copied is None:
        return False
    (host_confidence, host_accepted), done = copied
    info = dict(getattr(logits_output, "customized_info", None) or {})
    info.update(dspine_confidence_logits=HostRows(host_confidence, done),
                dspine_accept_lens=HostRows(host_accepted, done))
    logits_output.customized_info = info
    return True


class DSpineDraftSampler:
    """DSpine's transition selection folded into the draft CUDA graph (SGLang 0.5.17).

    Called by the capture hook as `sampler(hidden_states [n*N, H], input_ids [n*N])` (n = the graph
    batch, padded rows included) and writes the proposals to `out[:n*(N-1)]`, which the worker reads
    after replay. Greedy (Viterbi) for every row: `temperatures` stays 0 (see the module docstring).
    Static shapes and buffers only; no host sync."""

    def __init__(self, *, draft_model: DSpineDraftModel, block_size: int, max_bs: int, device) -> None:
        self.draft_model = draft_model
        self.block_size = int(block_size)
        gamma = self.block_size - 1
        self.out = torch.empty((int(max_bs) * gamma,), dtype=torch.int64, device=device)
        self.temperatures = torch.zeros((int(max_bs),), dtype=torch.float32, device=device)
        self.uniforms = torch.zeros((int(max_bs), gamma), dtype=torch.float32, device=device)

    def __call__(self, hidden_states: Tensor, input_ids: Tensor) -> None:
        n = hidden_states.shape[0] // self.block_size
        blocks = hidden_states.view(n, self.block_size, -1)
        anchors = input_ids.view(n, self.block_size)[:, 0]
        tokens, _, _ = self.draft_model.propose(blocks[:, 1:], anchors, self.temperatures[:n], self.uniforms[:n])
        self.out[: tokens.numel()].copy_(tokens.reshape(-1))


def _is_verify_step(batch) -> bool:
    """A decode step (draft + verify), by DFlash's own tests: not a prefill (`is_extend()` or
    `is_extend_in_batch`), not an idle DP rank."""
    mode = getattr(batch, "forward_mode", None)
    if mode is None or mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
        return False
    return not getattr(mode, "is_idle", lambda: False)()


class DSpineWorkerV2(DFlashWorkerV2):
    """The DSPINE worker (see the module docstring). SGLang builds it as
    `DSpineWorkerV2(server_args=, gpu_id=, [ps=,] nccl_port=, target_worker=)`."""

    # Static speculation until __init__ reads the environment (SGLang's `__getattr__` would send a
    # missing attribute to the target worker).
    _step_policy = "static"
    _switch: Optional[ServingSwitch] = None
    _plain_step: Optional[PlainStep] = None
    _plain_tokens: Optional[int] = None
    _record_steps = False
    _history: Optional[SlotTokenHistory] = None
    _round_graphs: Optional[RoundGraphs] = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        check_served_flags(self.server_args)      # `dspine serve`'s flags, each in effect or a clear stop
        switch = resolve_step_switch()
        self._step_policy = "static" if switch is None else switch.policy
        self._plain_tokens = None if switch is None else switch.plain_tokens
        if isinstance(switch, SwitchConfig):
            self._switch = ServingSwitch(switch, int(self.block_size))
        self._pending_confidence = collections.deque()   # (rids, host logits [bs, N-1], event) per drafted step
        self._record_steps = step_clock.recording()
        self._attach_target_to_draft()

    def _attach_target_to_draft(self) -> None:
        model = self.draft_model
        if not isinstance(model, DSpineDraftModel):
            raise TypeError(f"--speculative-algorithm DSPINE needs a DSpine draft checkpoint (architectures "
                            f"[\"DSpineDraftModel\"]), got {type(model).__name__}")
        hf_config = self.target_worker.model_runner.model_config.hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        check_target_compatible(model.dspine_config, text_config,  # vocab, hidden, layers, ids, mask id, fingerprint
                                saved_target=getattr(model.config, "dspine_target", None))
        target = self.target_worker.model_runner.model
        head = compat.unwrap_lora_layer(getattr(target, "lm_head", None))
        if head is None or not hasattr(head, "weight"):
            raise RuntimeError("DSPINE needs the target model to expose `lm_head` with a dense `weight`")
        model.attach_target_head(head, tp_group=compat.tp_group())
        self._dspine_record_confidence = False
        wants_record = env.DSPINE_RECORD_CONFIDENCE.get()
        if wants_record or self._switch is not None:
            requests = compat.server_args_value(self.server_args, "max_running_requests") or 0
            rows = max(int(requests), compat.decode_graph_max_bs(), 1) * (int(model.block_size) - 1)
            recording = model.enable_confidence_record(rows, head.weight.device)
            if self._switch is not None and not recording:
                raise FlagError(f"{env.DSPINE_DYNAMIC.name} needs a drafter with a confidence head and transition "
                                "selection (its confidence drives the switch); this one has none "
                                "(the argmax ablation?). "
                                f"Fix: unset {env.DSPINE_DYNAMIC.name} or serve a DSpine drafter")
            self._dspine_record_confidence = recording and wants_record
            if wants_record and not recording:
                logger.warning("DSPINE: %s=1 but this drafter has no confidence head or no transition selection "
                               "(the argmax ablation); nothing is recorded.", RECORD_CONFIDENCE_ENV)
            elif wants_record:
                logger.info("DSPINE: recording per-step confidence logits into meta_info (%s=1; adds a "
                            "device-to-host copy per step, meant for `dspine tune-sps` calibration runs).",
                            RECORD_CONFIDENCE_ENV)
        logger.info("DSPINE: target lm_head attached (selection=%s, injection=%s, block=%d, tp=%d, selector seam=%s).",
                    model.dspine_config.selection, model.dspine_config.injection, model.block_size,
                    int(getattr(compat.tp_group(), "world_size", 1)), compat.has_selector_seam())

    def _attach_token_history(self) -> None:
        """Copy candidates (`dspine_config.copy_candidates`): keep every request's tokens on the
        device (`SlotTokenHistory`, rows of SGLang's req_to_token pool) for the draft model. The copy
        path scores the whole vocabulary through the unsharded head, so under tensor parallelism the
        drafter serves without copy candidates (logged) instead of refusing to start."""
        cfg = self.draft_model.dspine_config
        if not cfg.copy_candidates:
            return
        tp_size = int(getattr(compat.tp_group(), "world_size", 1))
        if tp_size != 1:
            logger.warning("DSPINE copy candidates need tensor parallel size 1 (this server: %d); serving without "
                           "them. Serve with --tp 1 to use them.", tp_size)
            return
        pool = self.target_worker.model_runner.req_to_token_pool.req_to_token
        requests = compat.server_args_value(self.server_args, "max_running_requests") or 0
        self._history = SlotTokenHistory(pool_rows=int(pool.shape[0]), max_context_len=int(pool.shape[1]),
                                         block_size=int(self.block_size), window=cfg.copy_history_window,
                                         max_bs=max(int(requests), int(pool.shape[0]), compat.decode_graph_max_bs()),
                                         device=pool.device)
        self.draft_model.attach_token_history(self._history)
        logger.info("DSPINE copy candidates on: suffix match over the last %d tokens of each request (match %d..%d "
                    "tokens, %s scores).", cfg.copy_history_window, cfg.copy_min_match, cfg.copy_max_match,
                    cfg.copy_score)

    # ------------------------------------------------------------------------ speculation switch
    def init_cuda_graphs(self):
        self._attach_token_history()      # SGLang's request pool exists by now; the draft graph reads the history
        self._log_verify_scratch()
        check_running_cap(self.server_args, self.target_worker.model_runner.max_running_requests)
        super().init_cuda_graphs()
        if str(self.device).startswith("cuda"):
            seconds = warm_sampling_kernels(self.draft_model.dspine_config.vocab_size, self.device)
            logger.info("DSPINE: SGLang's sampling kernels warmed in %.1f s (flashinfer builds them on first use).",
                        seconds)
        self._round_graphs = build_round_graphs(self, history=self._history)
        if self._step_policy in ("dynamic", "plain"):
            refusal = mamba_pool.plain_step_refusal(self.target_worker)
            if refusal is not None:
                raise FlagError(refusal)
            self._plain_step = PlainStep(self, self._plain_tokens)
            logger.info("DSPINE speculation switch: %s; %d target tokens per plain step.",
                        "per-step decisions from " + str(env.DSPINE_DYNAMIC.get())
                        if self._switch is not None else "every decode step plain (a forced plain switch file)",
                        self._plain_tokens)

    def _log_verify_scratch(self) -> None:
        """One start-up line for a hybrid target under ReplaySSM: its verify scratch per request against
        per-token snapshots, from the pools as allocated (they exist from `init_cuda_graphs` on, not yet
        in `__init__`)."""
        scratch = mamba_pool.verify_scratch(self.target_worker, int(self.block_size))
        if scratch is not None:
            logger.info("DSPINE ReplaySSM verify scratch per request: %d bytes (ring %d + conv windows %d, as "
                        "allocated) against %d bytes of per-token snapshots (SSM states %d + conv windows %d): "
                        "%.1fx smaller.", scratch.replayssm, scratch.replay_records, scratch.replay_conv,
                        scratch.snapshot, scratch.snapshot_state, scratch.snapshot_conv, scratch.ratio)

    def _drafts_this_step(self, batch) -> bool:
        """The switch's decision for this decode step (True: draft; static servers always draft)."""
        if self._plain_step is None or getattr(batch, "has_grammar", False) \
                or has_penalties(getattr(batch, "sampling_info", None)):
            return True
        if self._switch is None:
            return False                                  # a forced plain switch file
        self._observe_pending_confidence()
        drafts = self._switch.decide([req.rid for req in batch.reqs])
        if (self._switch.drafted + self._switch.plain) % SWITCH_LOG_EVERY == 0:
            logger.info("DSPINE switch: %d decode steps, %.1f%% plain (batch of %d now: %s).",
                        self._switch.drafted + self._switch.plain,
                        100.0 * self._switch.plain / (self._switch.drafted + self._switch.plain),
                        len(batch.reqs), "draft" if drafts else "plain")
        return drafts

    def _observe_pending_confidence(self) -> None:
        """Hand the drafted steps' confidences whose copies have landed to the switch (no sync)."""
        pending = self._pending_confidence
        while pending and (pending[0][2] is None or pending[0][2].query()):
            rids, host, _ = pending.popleft()
            self._switch.observe(rids, host)

    def _record_drafted_step(self, batch, result) -> None:
        """Copy this drafted step's confidence logits [bs, N-1] to the host on the step's stream (the
        switch reads them once landed, usually a step or two later); tag the step's verify width."""
        rids = [req.rid for req in batch.reqs]
        if getattr(result, "logits_output", None) is not None:
            tag_verify_tokens(result.logits_output, len(rids), int(self.block_size))
        copied = confidence_to_host(self.draft_model, len(rids)) if rids else None
        if copied is None:
            return
        (host,), done = copied
        if len(self._pending_confidence) >= MAX_PENDING_CONFIDENCE:
            self._pending_confidence.popleft()
        self._pending_confidence.append((rids, host, done))

    def _dspine_selects(self) -> bool:
        """DSpine's own sampler runs where SGLang has no selector seam and selection is on."""
        return self.draft_model.candidate_selector is not None and not compat.has_selector_seam()

    def forward_batch_generation(self, batch, *args, **kwargs):
        verify_step = _is_verify_step(batch)
        drafts = verify_step and self._drafts_this_step(batch)
        kind = self._round_graphs.kind_for(batch) if drafts and self._round_graphs is not None else None
        if kind is not None:
            return self._round_step(batch, kind, kwargs.get("on_publish", args[0] if args else None))
        if self._history is None:
            return self._forward_step(batch, verify_step, drafts, *args, **kwargs)
        history = self._history
        if verify_step:   # the anchor sits at position seq_lens; the step commits after it
            slots, prefix = batch.req_pool_indices.clone(), batch.seq_lens.clone()
            history.prepare_draft(slots, prefix)
        result = self._forward_step(batch, verify_step, drafts, *args, **kwargs)
        if verify_step:
            history.write_committed(slots, prefix, result.next_token_ids.view(len(batch.reqs), -1))
        elif batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False):
            history.write_prefill(batch.req_pool_indices, [compat.request_fill_ids(r) for r in batch.reqs],
                                  result.next_token_ids)
        return result

    def _round_step(self, batch, kind: str, on_publish):
        """A drafted round through the captured round graphs (`kind`: greedy or sampled; history
        writes included)."""
        started = time.perf_counter() if self._record_steps else 0.0
        self.draft_model.ensure_transfer_table(serving=True)
        if self._record_steps:
            step_clock.CLOCK.tick("draft", len(batch.reqs), started)
        result = self._round_graphs.run(batch, kind, on_publish)
        self._after_drafted_step(batch, result)
        return result

    def _forward_step(self, batch, verify_step: bool, drafts: bool, *args, **kwargs):
        started = time.perf_counter() if self._record_steps else 0.0
        self.draft_model.ensure_transfer_table(serving=True)
        if verify_step and not drafts:
            if self._record_steps:
                step_clock.CLOCK.tick("plain", len(batch.reqs), started)
            if getattr(batch, "return_logprob", False):
                raise ValueError("DSPINE speculative decoding does not support return_logprob yet.")
            self._validate_phase1_sampling_support(batch)
            return self._plain_step.run(batch, kwargs.get("on_publish", args[0] if args else None))
        if self._record_steps:
            step_clock.CLOCK.tick("draft" if verify_step else None, len(batch.reqs) if verify_step else 0, started)
        if verify_step and self._needs_track_refresh():
            compat.prepare_mamba_track_for_verify(batch)
        result = super().forward_batch_generation(batch, *args, **kwargs)
        if verify_step:
            self._after_drafted_step(batch, result)
        return result

    def _after_drafted_step(self, batch, result) -> None:
        if self._switch is not None:
            self._record_drafted_step(batch, result)
        if getattr(self, "_dspine_record_confidence", False):
            attach_confidence_record(result, self.draft_model)

    def _needs_track_refresh(self) -> bool:
        """0.5.17 on a ReplaySSM target: DFlash's verify leaves the batch's GDN track slots at the
        prefill's (owned by the radix cache), so the commit after verify would write a state into a
        cached slot. Rebuild them from the requests first, as DSPARK and 0.5.20+'s DFlash do."""
        return (getattr(self, "_need_mamba_verify_commit", False) and not compat.dflash_verify_refreshes_mamba_track()
                and compat.replayssm_commit_active(self.target_worker))

    # ---------------------------------------------------------------- token choice, 0.5.17
    def _maybe_build_draft_sampler(self):
        if not self._dspine_selects():
            return super()._maybe_build_draft_sampler()
        if compat.eager_draft_sampler_forced():
            logger.info("DSPINE draft selection kept eager (SGLANG_DFLASH_EAGER_DRAFT_SAMPLER=1).")
            return None
        logger.info("DSPINE transition selection folded into the draft cuda graph.")
        return DSpineDraftSampler(draft_model=self.draft_model, block_size=self.block_size,
                                  max_bs=compat.decode_graph_max_bs(), device=self.device)

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states: Tensor, lm_head, chunk_size: int = 256):
        if not self._dspine_selects():
            return super()._greedy_sample_from_vocab_parallel_head(hidden_states=hidden_states, lm_head=lm_head,
                                                                     chunk_size=chunk_size)
        if hidden_states.numel() == 0:
            return torch.empty((0,), dtype=torch.long, device=hidden_states.device)
        gamma = int(self.block_size) - 1
        bs = hidden_states.shape[0] // gamma
        anchors = self._draft_block_ids_buf[:bs, 0]
        zeros = torch.zeros((bs,), dtype=torch.float32, device=hidden_states.device)
        uniforms = torch.zeros((bs, gamma), dtype=torch.float32, device=hidden_states.device)
        tokens, _, _ = self.draft_model.propose(hidden_states.view(bs, gamma, -1), anchors, zeros, uniforms)
        return tokens.reshape(-1)

    # -------------------------------------------------------------------- ReplaySSM commit
    def _update_target_mamba_state_after_verify(self, *, batch, seq_lens_pre_verify, commit_lens, **kwargs) -> None:
        """0.5.17 passes (batch, seq_lens_pre_verify, commit_lens); 0.5.22 adds seq_lens_post_verify."""
        if not self._need_mamba_verify_commit:
            return
        if not compat.replayssm_commit_active(self.target_worker):
            return super()._update_target_mamba_state_after_verify(
                batch=batch, seq_lens_pre_verify=seq_lens_pre_verify, commit_lens=commit_lens, **kwargs)
        bs, width = int(commit_lens.shape[0]), int(self.block_size)
        rows = torch.arange(bs, dtype=torch.int64, device=commit_lens.device)
        accept_index = rows[:, None] * width + torch.arange(width, dtype=torch.int64, device=commit_lens.device)
        # batch.seq_lens is still pre-verify here (the DFlash worker returns new_seq_lens instead).
        compat.commit_mamba_states_after_verify(self.target_worker, batch, accept_lens=commit_lens,
                                                accept_index=accept_index, draft_token_num=width)
