"""`PlainStep`: the DSPINE worker's plain decoding step (one token per request, no draft).

The off side of the speculation switch (`dspine.serving_switch`). SGLang's DFlash worker captures
the target's verify graphs at one width, N tokens per request, so a step that skipped the draft but
kept that graph would still pay an N-token verify. `PlainStep` captures a second set of target
graphs at width 1 (TARGET_VERIFY mode with one token per request, FULL hidden capture), with an
attention backend of its own workspace, as SGLang's EAGLE adaptive runtime states do for each step
count, and swaps both into the target's model runner for the plain step only (`active()`).

One plain step over a decode batch of bs requests (the DFlash draft input holds each request's last
committed token, the "bonus"):

1. anchor = that token, position = the request's sequence length, KV slot =
   `req_to_token[req, seq_len]` (the scheduler reserves a block of slots per step either way);
2. target forward of width 1: logits [bs, V], aux hidden states [bs, H_ctx];
3. next token: the verify's logit adjustments (penalties, bias), then argmax, or at T > 0 SGLang's
   DFlash sampler with no proposal to accept (a sample from the adjusted distribution);
4. the anchor's target hidden states go into the draft KV cache at its slot, exactly what a
   drafting step commits for an accepted position, so the drafter's context never has a gap;
5. the result in the DFlash format: out tokens [bs, N] with the new token in column 0, commit
   lengths 1, sequence lengths + 1; SGLang's `customized_info` gets one `dspine_plain_steps` entry
   per request, so `meta_info.dspine_plain_steps` has one element per plain step of the request
   (`spec_verify_ct` counts plain steps too).

The worker keeps drafting for grammar-constrained batches and hybrid (ReplaySSM) targets.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.speculative import dflash_worker_v2 as dflash

logger = logging.getLogger(__name__)
PLAIN_STEP_KEY = "dspine_plain_steps"


def _graph_runner_class(model_runner):
    """The target's decode graph runner class (0.5.17 names it through a method; else the import)."""
    factory = getattr(model_runner, "_decode_cuda_graph_runner_cls", None)
    if factory is not None:
        return factory()
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    return DecodeCudaGraphRunner


class PlainStep:
    """Built by the worker after SGLang captured its own graphs (`init_cuda_graphs`)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.runner = worker.target_worker.model_runner
        saved = getattr(self.runner, "init_new_workspace", None)
        try:
            self.attn_backend = self.runner._get_attention_backend(init_new_workspace=True)
        finally:
            if saved is not None:
                self.runner.init_new_workspace = saved
        self.graph_runner = None
        if self.runner.decode_cuda_graph_runner is not None:   # SGLang captured graphs: so do we
            with self.active():
                self.graph_runner = _graph_runner_class(self.runner)(
                    self.runner, attn_backend=self.attn_backend, speculative_num_draft_tokens=1)
        logger.info("DSPINE plain step ready (one token per request, %s).",
                    "CUDA graphs for batch sizes up to %d" % self.graph_runner.max_bs if self.graph_runner
                    else "eager")

    @contextlib.contextmanager
    def active(self):
        """The width-1 attention backend and graph runner in the target's model runner, restored after."""
        runner = self.runner
        saved = runner.attn_backend, runner.decode_cuda_graph_runner
        runner.attn_backend = self.attn_backend
        if self.graph_runner is not None:
            runner.decode_cuda_graph_runner = self.graph_runner
        try:
            yield
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def run(self, batch, on_publish=None):
        """One plain step for the decode `batch` (a ScheduleBatch whose spec_info is the DFlash draft
        input); returns SGLang's GenerationBatchResult in the DFlash format (module docstring)."""
        w = self.worker
        draft_input = batch.spec_info
        if batch.seq_lens.is_cuda:
            batch.seq_lens.record_stream(torch.cuda.current_stream())
        bs, width = len(batch.seq_lens), int(w.block_size)
        prefix_lens = batch.seq_lens
        tokens = draft_input.bonus_tokens.view(-1).to(torch.int64)
        positions = prefix_lens.to(torch.int64)
        req_to_token = w.model_runner.req_to_token_pool.req_to_token
        cache_loc = req_to_token[batch.req_pool_indices.long(), positions].to(torch.int64)

        verify_input = dflash.DFlashVerifyInput(draft_token=tokens, positions=positions, draft_token_num=1,
                                                custom_mask=None, capture_hidden_mode=dflash.CaptureHiddenMode.FULL)
        batch.out_cache_loc = cache_loc
        seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
        if seq_lens_cpu is not None:                      # host bound: committed prefix + this token
            batch.seq_lens_cpu = seq_lens_cpu + 1
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        elif getattr(draft_input, "reserved_seq_lens_cpu", None) is not None:
            batch.seq_lens_cpu = draft_input.reserved_seq_lens_cpu
            batch.seq_lens_sum = int(draft_input.reserved_seq_lens_sum)
        with self.active():
            forward_batch, _ = verify_input.prepare_for_verify(batch, w.target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
            out = w.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True,
                                                           skip_attn_backend_init=True)
        logits_output = out.logits_output
        logits = logits_output.next_token_logits
        sampling_info = batch.sampling_info
        if sampling_info is not None:
            dflash.apply_dflash_verify_logits_adjustments(next_token_logits=logits, sampling_info=sampling_info,
                                                          draft_token_num=1)
        if (sampling_info is not None and not sampling_info.is_all_greedy
                and dflash.is_dflash_sampling_verify_available()):
            _, next_ids = dflash.compute_dflash_sampling_correct_drafts_and_bonus(
                candidates=tokens.view(bs, 1), next_token_logits=logits, sampling_info=sampling_info,
                max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
        else:
            next_ids = torch.argmax(logits, dim=-1)
        next_ids = next_ids.view(-1).to(torch.int64)

        commit_lens = torch.ones((bs,), dtype=torch.int32, device=prefix_lens.device)
        new_seq_lens = prefix_lens + 1
        if on_publish is not None:
            on_publish(new_seq_lens)
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DSPINE plain step: the target returned no hidden states for the drafter's context")
        w._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden.reshape(bs, -1), cache_loc=cache_loc,
                                                   positions=positions)
        logits_output.hidden_states = None
        info = dict(getattr(logits_output, "customized_info", None) or {})
        info[PLAIN_STEP_KEY] = [1] * bs         # meta_info.dspine_plain_steps: one entry per plain step
        logits_output.customized_info = info
        out_tokens = torch.zeros((bs, width), dtype=torch.int64, device=next_ids.device)
        out_tokens[:, 0] = next_ids
        return dflash.GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
            can_run_cuda_graph=out.can_run_cuda_graph,
            next_draft_input=w._make_next_draft_input_decode(bonus_tokens=next_ids, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=width, new_seq_lens=new_seq_lens)
