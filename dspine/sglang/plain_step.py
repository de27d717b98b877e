"""`PlainStep`: the DSPINE worker's plain decoding step (K target tokens per request, no draft).

The off side of the speculation switch (`dspine.dynamic.switch`). SGLang's DFlash worker captures
the target's graphs in TARGET_VERIFY mode, N tokens per request, and that mode runs its attention as
an extend over the prefix: even at one token per request it costs far more than a decode step (the
H200 run measured 2.6 ms against AR's 1.2 ms at one request). `PlainStep` gives the target a second
set of graphs in DECODE mode (SGLang's AR decode path and kernels), captured with FULL hidden-state
capture for the drafter's context and an attention backend of its own workspace, as SGLang's EAGLE
adaptive runtime states do for each step count; `active()` swaps them into the target's model runner
for the plain step only.

One plain step of K tokens (`tokens`, 1 <= K <= N) over a decode batch of bs requests (the DFlash
draft input holds each request's last committed token, the "bonus"):

1. K times: the batch is presented to the target worker as an AR decode batch: input = the last
   token, sequence lengths + i + 1, KV slot = `req_to_token[req, seq_len + i]` (the scheduler
   reserves a block of N slots per request and step either way), no spec input; restored afterwards;
2. the target worker runs it as it runs AR (decode graph, then SGLang's own sampler: greedy or
   sampled exactly as AR) with FULL hidden capture: next tokens [bs], aux hidden states [bs, H_ctx];
   so the K tokens are exactly the target's own AR continuation;
3. the K positions' target hidden states [bs*K, H_ctx] go into the draft KV cache at their slots in
   one call, exactly what a drafting step commits for accepted positions, so the drafter's context
   never has a gap;
4. the result in the DFlash format: out tokens [bs, N] with the K new tokens in columns 0..K-1,
   commit lengths K, sequence lengths + K; SGLang's `customized_info` gets one `dspine_verify_tokens`
   entry (1: the width of each target forward) per request, as a drafting step under the switch gets N.

Why K > 1: inside the speculative worker a one-token plain step costs far more than an AR step
(SmolLM2 at one request on an H200: 2.31 ms against 1.25 ms, `benchmarks/results/step_profile_h200.json`;
the difference is host work: the drafter's KV append, DFlash's KV reservation, speculative bookkeeping). A K-token plain step
pays that per-step work once per K tokens, like a drafting step whose proposals are always
accepted; each chained decode still costs about an AR step's time (K = 8 measured ~1.1 ms each).
Tokens past a request's end (stop token, max_tokens) are dropped by SGLang's result processing, as past-the-end accepted drafts are: at most K-1 wasted target forwards per request.

The worker drafts for grammar-constrained batches and batches with penalties (their state follows
the speculative path). A hybrid target's recurrent state is read and advanced in place by the AR
decode path, which is exact where every commit leaves that state current and the prefix cache
takes no decode snapshots (`dspine.sglang.mamba_pool.plain_step_refusal`, checked at start).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from sglang.srt.speculative import dflash_worker_v2 as dflash
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

logger = logging.getLogger(__name__)
VERIFY_TOKENS_KEY = "dspine_verify_tokens"
_DECODE_FIELDS = ("forward_mode", "input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "spec_info")


def _graph_runner_class(model_runner):
    """The target's decode graph runner class (0.5.17 names it through a method; else the import)."""
    factory = getattr(model_runner, "_decode_cuda_graph_runner_cls", None)
    if factory is not None:
        return factory()
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    return DecodeCudaGraphRunner


def capture_decode_graphs(model_runner, attn_backend):
    """SGLang's decode graph runner for the target in DECODE mode with FULL hidden capture: built while
    the runner's algorithm reads as none (a speculative runner is captured in TARGET_VERIFY mode)."""
    base = _graph_runner_class(model_runner)
    full = dflash.CaptureHiddenMode.FULL
    runner_class = type("DSpinePlainDecodeGraphRunner", (base,), {
        "return_hidden_states_mode": property(lambda self: full, lambda self, value: None)})
    algorithm = model_runner.spec_algorithm
    model_runner.spec_algorithm = SpeculativeAlgorithm.NONE
    try:
        return runner_class(model_runner, attn_backend=attn_backend)
    finally:
        model_runner.spec_algorithm = algorithm


def tag_verify_tokens(logits_output, bs: int, width: int) -> None:
    """`meta_info.dspine_verify_tokens`: one entry per decode step of a request (N drafting, 1 plain)."""
    info = dict(getattr(logits_output, "customized_info", None) or {})
    info[VERIFY_TOKENS_KEY] = [width] * bs
    logits_output.customized_info = info


class PlainStep:
    """Built by the worker after SGLang captured its own graphs (`init_cuda_graphs`)."""

    def __init__(self, worker, tokens: int = 1) -> None:
        if not 1 <= int(tokens) <= int(worker.block_size):
            raise ValueError(f"a plain step of {tokens} tokens: it must lie in [1, {worker.block_size}] (the block "
                             "size: SGLang reserves one block of KV slots per request and step)")
        self.worker, self.tokens = worker, int(tokens)
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
                self.graph_runner = capture_decode_graphs(self.runner, self.attn_backend)
        logger.info("DSPINE plain step ready (%d AR decode step(s) per scheduler step, %s).", self.tokens,
                    "CUDA graphs for batch sizes up to %d" % self.graph_runner.max_bs if self.graph_runner
                    else "eager")

    @contextlib.contextmanager
    def active(self):
        """The plain step's attention backend and graph runner in the target's model runner, restored after."""
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
        """One plain step of `self.tokens` tokens for the decode `batch` (a ScheduleBatch whose spec_info
        is the DFlash draft input); returns SGLang's GenerationBatchResult in the DFlash format."""
        w, k = self.worker, self.tokens
        draft_input = batch.spec_info
        if batch.seq_lens.is_cuda:
            batch.seq_lens.record_stream(torch.cuda.current_stream())
        bs, width = len(batch.seq_lens), int(w.block_size)
        prefix_lens = batch.seq_lens
        device = prefix_lens.device
        positions = prefix_lens.to(torch.int64)[:, None] + torch.arange(k, dtype=torch.int64, device=device)
        req_to_token = w.model_runner.req_to_token_pool.req_to_token
        cache_loc = req_to_token[batch.req_pool_indices.long()[:, None], positions].to(torch.int64)   # [bs, k]
        step_cache_loc = cache_loc.t().contiguous()                                                   # [k, bs]
        step_seq_lens = (positions + 1).t().to(prefix_lens.dtype).contiguous()                        # [k, bs]
        out_tokens = torch.zeros((bs, width), dtype=torch.int64, device=device)
        hidden = None

        saved = {name: getattr(batch, name) for name in _DECODE_FIELDS}
        base_sum = int(saved["seq_lens_cpu"].sum()) if saved["seq_lens_cpu"] is not None else saved["seq_lens_sum"]
        token = draft_input.bonus_tokens.view(-1).to(torch.int64)
        try:
            with self.active():
                batch.forward_mode, batch.spec_info = dflash.ForwardMode.DECODE, None
                for i in range(k):
                    batch.input_ids, batch.seq_lens, batch.out_cache_loc = token, step_seq_lens[i], step_cache_loc[i]
                    if saved["seq_lens_cpu"] is not None:
                        batch.seq_lens_cpu = saved["seq_lens_cpu"] + (i + 1)
                    if base_sum is not None:
                        batch.seq_lens_sum = base_sum + bs * (i + 1)
                    out = w.target_worker.forward_batch_generation(batch,
                                                                   capture_hidden_mode=dflash.CaptureHiddenMode.FULL)
                    token = out.next_token_ids.view(-1).to(torch.int64)
                    out_tokens[:, i] = token
                    step_hidden = out.logits_output.hidden_states
                    if step_hidden is None:
                        raise RuntimeError("DSPINE plain step: the target returned no hidden states for the "
                                           "drafter's context")
                    step_hidden = step_hidden.reshape(bs, -1)
                    if hidden is None:
                        hidden = step_hidden.new_empty((bs, k, step_hidden.shape[-1]))
                    hidden[:, i].copy_(step_hidden)     # the graph's output buffer is rewritten by the next replay
        finally:
            for name, value in saved.items():
                setattr(batch, name, value)

        new_seq_lens = prefix_lens + k
        commit_lens = torch.full((bs,), k, dtype=torch.int32, device=device)
        if on_publish is not None:
            on_publish(new_seq_lens)
        w._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden.reshape(bs * k, -1),
                                                   cache_loc=cache_loc.reshape(-1), positions=positions.reshape(-1))
        logits_output = out.logits_output
        logits_output.hidden_states = None
        tag_verify_tokens(logits_output, bs, 1)
        return dflash.GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
            can_run_cuda_graph=out.can_run_cuda_graph,
            next_draft_input=w._make_next_draft_input_decode(bonus_tokens=token, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=width, new_seq_lens=new_seq_lens)
