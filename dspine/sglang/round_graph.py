"""`RoundGraphs`: a DSPINE decode round as five CUDA-graph launches, no per-step planning.

SGLang's DFlash round (the path `DSpineWorkerV2` inherits) plans each of its two forwards on the
host: it builds a `ForwardBatch`, copies it into the graph runner's static buffers
(`load_batch`: registry fill, attention metadata), replays, then runs the accept rule, the
drafter-KV append and the token-history writes as eager launches. At small models that host work,
not the GPU, sets the round's period. Here everything between the two forwards is captured too:

    G1[n]   block ids (anchor + masks), positions, verify slots, mask embeddings, history rows,
            with a draft window the drafter's compact request rows (DFlash's own rebuild), and the
            draft runner's own `load_batch` (buffer fill + triton attention metadata)
    D[n]    SGLang's captured draft forward (the DSpine sampler writes `sampler.out` in it)
    G2[n]   verify ids (anchor + proposals), the target runner's `load_batch`
    T[n]    SGLang's captured TARGET_VERIFY forward (logits [n*B, V], DFlash aux hidden)
    G3[n]   argmax, accept rule, commit, drafter-KV append, token-history commit
            (G3s[n] for sampled batches: DFlash's sampled verify instead of the argmax, reading
            the batch's temperature, top-k and top-p from static rows)

for every batch size n both runners captured. `load_batch` is host code that only launches
kernels over static buffers when the batch it is given *is* static buffers at a captured size
(no padding decisions, no host reads; triton attention never reads `seq_lens_cpu`), so running
it inside G1/G2's capture records exactly the work it would redo every step.

Per round the host copies the live request rows (pool slot, committed length, anchor; for a
sampled batch its sampling parameters) into the static inputs, pads rows n..N to SGLang's padding row (slot 0: its `req_to_token` row is never
allocated, so every padded write lands in KV slot 0) and launches the five graphs. Outputs are
copied into one of two ring slots, as DFlash's own accept buffers are, so a result the overlap
scheduler still holds survives the next round.

Used only where it is exactly the DFlash round (`round_kind`): batches without penalties, logit
bias, custom logit processors, grammars or logprobs, greedy (argmax verify) or, with
`DSPINE_ROUND_GRAPH=all`, sampled with temperature, top-k and top-p (DFlash's sampled verify,
where this SGLang build has it); tp = 1,
triton attention on both runners, full CUDA graphs, no hybrid (ReplaySSM) target, and SGLang
without the DFlash selector seam (0.5.17; on 0.5.20+ SGLang's selector sampler stages its inputs
on the host each step). Anything else takes SGLang's path, step by step. `DSPINE_ROUND_GRAPH=0`
turns it off.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Callable, Optional

import torch
from torch import Tensor

from dspine import env

logger = logging.getLogger(__name__)

PAD_SEQ_LEN = 1        # SGLang's cuda-graph fill value for padded seq_lens (triton attention)
RING_SLOTS = 2
STAGES = ("g1", "draft", "g2", "verify", "g3")


def commit_tokens(verify_ids: Tensor, accept_len: Tensor, bonus: Tensor,
                  prefix_lens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What a verify commits, as DFlash lays it out: verify_ids [n, B] (anchor, then B-1 proposals),
    accept_len [n] accepted proposals, bonus [n] the target's token after them, prefix_lens [n].
    Returns (out_tokens [n, B] int64: the accepted proposals then the bonus at column accept_len,
    later columns stale; commit_lens [n] int32 = accept_len + 1; bonus [n] int64; new_seq_lens [n]
    int64 = prefix_lens + commit_lens)."""
    n, width = verify_ids.shape
    accept_len = accept_len.to(torch.int64)
    bonus = bonus.to(torch.int64)
    out_tokens = torch.zeros((n, width), dtype=torch.int64, device=verify_ids.device)
    out_tokens[:, : width - 1] = verify_ids[:, 1:]
    out_tokens.scatter_(1, accept_len[:, None], bonus[:, None])
    return out_tokens, (accept_len + 1).to(torch.int32), bonus, prefix_lens.to(torch.int64) + accept_len + 1


def accept_greedy(verify_ids: Tensor, target_top1: Tensor, prefix_lens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The DFlash greedy accept rule on static shapes: target_top1 [n, B] is the target's argmax
    after each verify position; a proposal is accepted while it equals the argmax before it, and
    the bonus is the argmax after the last accepted one. Returns `commit_tokens`'s tuple."""
    matches = (verify_ids[:, 1:] == target_top1[:, :-1]).to(torch.int64)
    accept_len = torch.cumprod(matches, dim=1).sum(dim=1)                      # [n]
    bonus = target_top1.gather(1, accept_len[:, None]).squeeze(1)
    return commit_tokens(verify_ids, accept_len, bonus, prefix_lens)


def round_kind(batch) -> Optional[str]:
    """"greedy" when this decode batch's verify is the plain argmax DFlash runs for all-greedy
    batches, "sampled" when it is DFlash's sampled verify with nothing else (temperature, top-k and
    top-p only), None otherwise (logit bias, penalties, custom logit processors, grammars, logprobs:
    SGLang's path)."""
    if getattr(batch, "return_logprob", False) or getattr(batch, "has_grammar", False):
        return None
    info = getattr(batch, "sampling_info", None)
    if info is None:
        return "greedy"
    if getattr(info, "has_custom_logit_processor", False) or has_penalties(info):
        return None
    if any(getattr(info, name, None) is not None for name in ("logit_bias", "grammar_mask", "vocab_mask")):
        return None
    return "greedy" if getattr(info, "is_all_greedy", False) else "sampled"


def has_penalties(sampling_info) -> bool:
    """Frequency / presence / repetition penalties on a batch's sampling info: a live orchestrator
    (the scheduler's copy) or the penalties it accumulated for the forward (under overlap
    scheduling the worker gets a copy whose orchestrator is None: `copy_for_forward`)."""
    orchestrator = getattr(sampling_info, "penalizer_orchestrator", None)
    if bool(getattr(orchestrator, "is_required", False)):
        return True
    return any(getattr(sampling_info, name, None) is not None
               for name in ("acc_additive_penalties", "acc_scaling_penalties", "acc_linear_penalties"))


class StageClock:
    """Device time of each captured-round stage (`DSPINE_ROUND_TIMING=N`, a diagnostic): events
    recorded between the five launches; finished rounds are read with `query()` (no host sync) and
    every `every` of them the mean ms per stage and batch size is logged. `make_event` builds a
    timing event (tests pass a stand-in)."""

    def __init__(self, every: int, make_event: Callable[[], object]) -> None:
        self.every, self.make_event = int(every), make_event
        self.pending: list[tuple[int, list]] = []
        self.totals: dict[int, list[float]] = {}   # batch size -> [rounds, ms per stage...]
        self.finished = 0

    def mark(self, events: list) -> None:
        event = self.make_event()
        event.record()
        events.append(event)

    def round_done(self, n: int, events: list) -> None:
        """The round's len(STAGES) + 1 events are recorded; collect every finished round."""
        self.pending.append((n, events))
        while self.pending and self.pending[0][1][-1].query():
            size, done = self.pending.pop(0)
            row = self.totals.setdefault(size, [0.0] * (1 + len(STAGES)))
            row[0] += 1
            for i in range(len(STAGES)):
                row[1 + i] += done[i].elapsed_time(done[i + 1])
            self.finished += 1
            if self.finished % self.every == 0:
                logger.info("DSPINE round stages (device ms, mean): %s", self.summary())

    def summary(self) -> str:
        return "; ".join(f"bs {size}: " + " ".join(f"{name} {total / row[0]:.3f}"
                                                    for name, total in zip(STAGES, row[1:]))
                         for size, row in sorted(self.totals.items()))


class _Buffers:
    """Static inputs and intermediates of every captured round (rows = the largest batch N)."""

    def __init__(self, max_bs: int, block_size: int, hidden: int, embed_dtype, device) -> None:
        rows, width = int(max_bs), int(block_size)
        i64 = dict(dtype=torch.int64, device=device)
        self.req_pool_indices = torch.zeros((rows,), **i64)
        self.prefix_lens = torch.full((rows,), PAD_SEQ_LEN, **i64)
        self.bonus = torch.zeros((rows,), **i64)
        self.block_ids = torch.zeros((rows, width), **i64)
        self.positions = torch.zeros((rows, width), **i64)
        self.cache_loc = torch.zeros((rows, width), **i64)
        self.verify_ids = torch.zeros((rows, width), **i64)
        self.draft_lens = torch.full((rows,), PAD_SEQ_LEN, dtype=torch.int32, device=device)  # window-clamped
        self.embeds = torch.zeros((rows * width, int(hidden)), dtype=embed_dtype, device=device)
        self.offsets = torch.arange(width, **i64)
        # Sampling parameters of a sampled round (padding rows: top-k 1, i.e. greedy).
        self.temperatures = torch.ones((rows,), dtype=torch.float32, device=device)
        self.top_ks = torch.ones((rows,), dtype=torch.int32, device=device)
        self.top_ps = torch.ones((rows,), dtype=torch.float32, device=device)
        # Outputs G3 writes: tokens [N*B] | bonus [N] | new_seq_lens [N] (int64), commit_lens [N] (int32).
        self.out64 = torch.zeros((rows * width + 2 * rows,), **i64)
        self.commit = torch.zeros((rows,), dtype=torch.int32, device=device)
        self.ring64 = [torch.zeros_like(self.out64) for _ in range(RING_SLOTS)]
        self.ring32 = [torch.zeros_like(self.commit) for _ in range(RING_SLOTS)]


class RoundGraphs:
    """The captured rounds of one worker (see the module docstring).

    `stages(n)` are our per-size stages (G1, G2, G3 and, with a sampled verify, G3s); `capture()`
    records them as CUDA graphs, and a round replays them around SGLang's two captured forwards.
    `kind_for(batch)` says whether (and how) a batch can run captured; `run(batch, kind, on_publish)`
    returns the step's `GenerationBatchResult`."""

    def __init__(self, worker, *, draft_runner, target_runner, draft_sampler, sizes: list[int],
                 history=None, sampled_accept: Optional[Callable] = None) -> None:
        self.worker = worker
        self.draft_runner, self.target_runner = draft_runner, target_runner
        self.sampler = draft_sampler
        self.history = history
        self.sizes = sorted(int(s) for s in sizes)
        self.block_size = int(worker.block_size)
        self.mask_id = int(worker._mask_token_id)
        self.device = worker.device
        self.compact = bool(getattr(worker, "use_compact_draft_cache", False))   # a draft window
        target = worker.target_worker.model_runner
        self.req_to_token = target.req_to_token_pool.req_to_token
        self.embed = target.model.get_input_embeddings()
        weight = self.embed.weight
        self.buf = _Buffers(self.sizes[-1], self.block_size, weight.shape[1], weight.dtype, self.device)
        self._draft_batches = {n: self._forward_batch(n, draft=True) for n in self.sizes}
        self._verify_batches = {n: self._forward_batch(n, draft=False) for n in self.sizes}
        self._graphs: dict[tuple[str, int], Callable[[], None]] = {}
        self._runner_keys: dict[tuple[str, int], object] = {}
        # DFlash's sampled verify (`compute_dflash_sampling_correct_drafts_and_bonus`), None: greedy only.
        self.sampled_accept = sampled_accept
        self._sampling_infos = {n: SimpleNamespace(
            temperatures=self.buf.temperatures[:n].view(n, 1), top_ks=self.buf.top_ks[:n], top_ps=self.buf.top_ps[:n],
            need_top_k_sampling=True, need_top_p_sampling=True) for n in self.sizes}
        self._ring = 0
        self.rounds = 0
        every = env.DSPINE_ROUND_TIMING.get()
        self.clock = StageClock(every, lambda: torch.cuda.Event(enable_timing=True)) if every else None

    # ------------------------------------------------------------------ building
    def _forward_batch(self, n: int, *, draft: bool):
        """A ForwardBatch whose tensors are the static buffers' first n rows (draft: the noise block
        with its mask embeddings and, with a draft window, the window-clamped lengths; verify: anchor
        + proposals, DFlash aux hidden captured)."""
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
        from sglang.srt.speculative.dflash_info import DFlashVerifyInput
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        b, width = self.buf, self.block_size
        ids = (b.block_ids if draft else b.verify_ids)[:n].view(-1)
        positions = b.positions[:n].view(-1)
        common = dict(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=n, input_ids=ids,
                      req_pool_indices=b.req_pool_indices[:n], seq_lens=b.prefix_lens[:n],
                      out_cache_loc=b.cache_loc[:n].view(-1), seq_lens_sum=n * PAD_SEQ_LEN,
                      seq_lens_cpu=torch.full((n,), PAD_SEQ_LEN, dtype=torch.int64), positions=positions)
        if draft:
            if self.compact:
                common["seq_lens"] = b.draft_lens[:n]
            fb = ForwardBatch(**common, input_embeds=b.embeds[: n * width],
                              spec_algorithm=SpeculativeAlgorithm.DFLASH,
                              spec_info=self.worker._draft_block_spec_info,
                              capture_hidden_mode=CaptureHiddenMode.NULL)
        else:
            spec = DFlashVerifyInput(draft_token=ids, positions=positions, draft_token_num=width,
                                     custom_mask=None, capture_hidden_mode=CaptureHiddenMode.FULL)
            fb = ForwardBatch(**common, spec_algorithm=self.target_runner.model_runner.spec_algorithm,
                              spec_info=spec, capture_hidden_mode=CaptureHiddenMode.FULL)
        fb.num_token_non_padded = torch.full((1,), n * width, dtype=torch.int32, device=self.device)
        return fb

    def _stage_draft_inputs(self, n: int) -> None:
        """G1: the noise block of every row and the draft runner's replay inputs."""
        b = self.buf
        prefix = b.prefix_lens[:n]
        b.block_ids[:n].fill_(self.mask_id)
        b.block_ids[:n, 0].copy_(b.bonus[:n])
        torch.add(prefix[:, None], b.offsets[None], out=b.positions[:n])
        b.cache_loc[:n].copy_(self.req_to_token[b.req_pool_indices[:n, None], b.positions[:n]])
        b.embeds[: n * self.block_size].copy_(self.embed(b.block_ids[:n].view(-1)))
        if self.compact:   # the drafter attends to the last `window` committed tokens, then the block
            b.draft_lens[:n].copy_(self.worker._compute_compact_draft_seq_lens(prefix))
            self.worker._rebuild_compact_draft_cache(
                req_pool_indices=b.req_pool_indices[:n], prefix_lens=prefix, draft_prefix_lens=b.draft_lens[:n],
                verify_out_cache_loc_2d=b.cache_loc[:n], bs=n, block_size=self.block_size)
        if self.history is not None:
            self.history.prepare_draft(b.req_pool_indices[:n], prefix)
        self.draft_runner.load_batch(self._draft_batches[n])

    def _stage_verify_inputs(self, n: int) -> None:
        """G2: anchor + the sampler's proposals, and the target runner's replay inputs."""
        b, gamma = self.buf, self.block_size - 1
        b.verify_ids[:n, 0].copy_(b.block_ids[:n, 0])
        b.verify_ids[:n, 1:].copy_(self.sampler.out[: n * gamma].view(n, gamma))
        self.target_runner.load_batch(self._verify_batches[n])

    def _commit(self, n: int, target_out, sampled: bool = False) -> None:
        """G3 (G3s when `sampled`): accept, commit, drafter-KV append and token-history commit for n
        rows. The sampled accept is DFlash's own, on the dense path (softmax, then top-k and top-p
        renormalisation of every row: the same distributions as its sparse top-k path, with shapes
        that do not depend on the batch's largest top-k)."""
        b, width = self.buf, self.block_size
        logits = target_out.next_token_logits[: n * width]
        if sampled:
            accept_len, bonus = self.sampled_accept(candidates=b.verify_ids[:n], next_token_logits=logits,
                                                    sampling_info=self._sampling_infos[n], use_sparse_topk=False)
            out_tokens, commit, bonus, new_seq_lens = commit_tokens(b.verify_ids[:n], accept_len, bonus,
                                                                    b.prefix_lens[:n])
        else:
            top1 = torch.argmax(logits, dim=-1).view(n, width)
            out_tokens, commit, bonus, new_seq_lens = accept_greedy(b.verify_ids[:n], top1, b.prefix_lens[:n])
        b.out64[: n * width].copy_(out_tokens.view(-1))
        b.out64[n * width: n * width + n].copy_(bonus)
        b.out64[n * width + n: n * width + 2 * n].copy_(new_seq_lens)
        b.commit[:n].copy_(commit)
        self.worker._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=target_out.hidden_states[: n * width], cache_loc=b.cache_loc[:n].view(-1),
            positions=b.positions[:n].view(-1), cache_loc_2d=b.cache_loc[:n], commit_lens=b.commit[:n])
        if self.history is not None:
            self.history.write_committed(b.req_pool_indices[:n], b.prefix_lens[:n], out_tokens)

    def _runner_output(self, role: str, n: int):
        runner = self.draft_runner if role == "draft" else self.target_runner
        return runner.backend._outputs[self._runner_keys[(role, n)]]

    def capture(self) -> None:
        """Capture G1/G2/G3 for every size, largest first, into one private memory pool. Each stage
        runs eagerly twice first (compiles its kernels, and any host sync fails there, not in the
        capture). Raises on any failure; the caller then keeps SGLang's path."""
        pool = torch.cuda.graph_pool_handle()
        started = time.perf_counter()
        with torch.inference_mode():
            for n in reversed(self.sizes):
                self._capture_size(n, pool)
        logger.info("DSPINE round graphs captured for batch sizes %s in %.1f s (%s).", self.sizes,
                    time.perf_counter() - started,
                    "greedy and sampled" if self.sampled_accept is not None else "greedy only")

    def stages(self, n: int) -> dict[str, Callable[[], None]]:
        """G1, G2, G3 (and G3s, the sampled commit) for n rows, as plain callables (what `capture`
        records)."""
        stages = {"g1": lambda: self._stage_draft_inputs(n), "g2": lambda: self._stage_verify_inputs(n),
                  "g3": lambda: self._commit(n, self._runner_output("target", n))}
        if self.sampled_accept is not None:
            stages["g3s"] = lambda: self._commit(n, self._runner_output("target", n), sampled=True)
        return stages

    def _capture_size(self, n: int, pool) -> None:
        stages = self.stages(n)
        sampled = stages.pop("g3s", None)
        with _host_syncs_raise():
            for _ in range(2):
                stages["g1"]()
                self._runner_keys[("draft", n)] = self.draft_runner._replay_graph_key   # load_batch picks it
                stages["g2"]()
                self._runner_keys[("target", n)] = self.target_runner._replay_graph_key
                stages["g3"]()
        torch.cuda.synchronize()
        for name, fn in stages.items():
            self._graphs[(name, n)] = _capture(fn, pool)
        if sampled is None:
            return
        try:   # the sampled commit is optional: greedy rounds stay captured without it
            with _host_syncs_raise():
                for _ in range(2):
                    sampled()
            torch.cuda.synchronize()
            self._graphs[("g3s", n)] = _capture(sampled, pool)
        except Exception as exc:
            logger.warning("DSPINE sampled rounds not captured (%s: %s); sampled batches take SGLang's DFlash path.",
                           type(exc).__name__, exc)
            torch.cuda.synchronize()
            self.sampled_accept = None
            for key in [k for k in self._graphs if k[0] == "g3s"]:
                del self._graphs[key]

    # ------------------------------------------------------------------ serving
    def size_for(self, bs: int) -> Optional[int]:
        for n in self.sizes:
            if n >= bs:
                return n
        return None

    def kind_for(self, batch) -> Optional[str]:
        """"greedy" or "sampled" when this batch's round can run captured, else None."""
        if not batch.reqs or self.size_for(len(batch.reqs)) is None:
            return None
        kind = round_kind(batch)
        return None if kind == "sampled" and self.sampled_accept is None else kind

    def run(self, batch, kind: str, on_publish=None):
        """One round of `kind` ("greedy" / "sampled", what `kind_for` said) for `batch`; SGLang's result."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        worker, b, width = self.worker, self.buf, self.block_size
        bs = len(batch.reqs)
        n = self.size_for(bs)
        if batch.seq_lens.is_cuda:   # carried over from the previous overlap iteration, maybe another stream
            batch.seq_lens.record_stream(torch.cuda.current_stream())
        draft_input = batch.spec_info
        b.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        b.prefix_lens[:bs].copy_(batch.seq_lens)
        b.bonus[:bs].copy_(draft_input.bonus_tokens.view(-1))
        if kind == "sampled":
            info = batch.sampling_info
            b.temperatures[:bs].copy_(info.temperatures.view(-1))
            b.top_ks[:bs].copy_(info.top_ks.view(-1))
            b.top_ps[:bs].copy_(info.top_ps.view(-1))
        if n > bs:
            b.req_pool_indices[bs:n].zero_()
            b.prefix_lens[bs:n].fill_(PAD_SEQ_LEN)
            b.bonus[bs:n].zero_()
            if kind == "sampled":
                b.temperatures[bs:n].fill_(1.0)
                b.top_ks[bs:n].fill_(1)
                b.top_ps[bs:n].fill_(1.0)
        launches = (self._graphs[("g1", n)], self.draft_runner.backend._graphs[self._runner_keys[("draft", n)]].replay,
                    self._graphs[("g2", n)], self.target_runner.backend._graphs[self._runner_keys[("target", n)]].replay,
                    self._graphs[("g3s" if kind == "sampled" else "g3", n)])
        if self.clock is None:
            for launch in launches:
                launch()
        else:
            events = []
            self.clock.mark(events)
            for launch in launches:
                launch()
                self.clock.mark(events)
            self.clock.round_done(n, events)
        slot = self._ring
        self._ring = (slot + 1) % RING_SLOTS
        out64, commit = b.ring64[slot], b.ring32[slot]
        out64.copy_(b.out64)
        commit.copy_(b.commit)
        out_tokens = out64[: n * width].view(n, width)[:bs]
        bonus = out64[n * width: n * width + bs]
        new_seq_lens = out64[n * width + n: n * width + n + bs]
        commit_lens = commit[:bs]
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.out_cache_loc = b.cache_loc[:bs].view(-1)
        target_out = self._runner_output("target", n)
        logits_output = LogitsProcessorOutput(next_token_logits=target_out.next_token_logits[: bs * width],
                                              hidden_states=None)
        self.rounds += 1
        return GenerationBatchResult(
            logits_output=logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
            can_run_cuda_graph=True,
            next_draft_input=worker._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=width, new_seq_lens=new_seq_lens)


def _capture(fn: Callable[[], None], pool) -> Callable[[], None]:
    """`fn` recorded into a CUDA graph in `pool`; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


@contextmanager
def _host_syncs_raise():
    """Any host-device synchronisation inside raises (it would break a capture)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def why_not_round_graphs(worker) -> Optional[str]:
    """None when the worker's rounds can be captured whole, else the reason they cannot."""
    if env.DSPINE_ROUND_GRAPH.get() == "0":
        return f"{env.DSPINE_ROUND_GRAPH.name}=0"
    if not torch.cuda.is_available() or not str(worker.device).startswith("cuda"):
        return "not a CUDA device"
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    from dspine.sglang import compat

    if compat.has_selector_seam():
        return (f"SGLang {compat.sglang_version()} drafts through its selector seam, whose sampler stages "
                "per-step inputs on the host (captured rounds are built for 0.5.17's runners)")
    if int(getattr(compat.tp_group(), "world_size", 1)) != 1:
        return "tensor parallelism (tp > 1)"
    if getattr(worker, "_need_mamba_verify_commit", False):
        return "a hybrid (ReplaySSM) target"
    sampler = getattr(worker, "_draft_sampler", None)
    if getattr(sampler, "out", None) is None:
        return "no in-graph draft sampler"
    runners = {"draft": worker.draft_model_runner, "target": worker.target_worker.model_runner}
    for role, model_runner in runners.items():
        runner = getattr(model_runner, "decode_cuda_graph_runner", None)
        if runner is None:
            return f"no {role} CUDA graphs"
        if not isinstance(getattr(runner, "backend", None), FullCudaGraphBackend):
            return f"the {role} runner's graph backend is {type(getattr(runner, 'backend', None)).__name__}"
        if getattr(runner, "ragged_verify_mode", False) or getattr(runner, "enable_two_batch_overlap", False) \
                or getattr(runner, "enable_pdmux", False):
            return f"the {role} runner replays ragged / two-batch / pdmux graphs"
        if not isinstance(getattr(runner, "attn_backend", None), TritonAttnBackend):
            return f"{role} attention backend {type(getattr(runner, 'attn_backend', None)).__name__} (needs triton)"
    from sglang.srt.speculative import spec_utils
    if int(getattr(spec_utils, "SIMULATE_ACC_LEN", 0) or 0) > 0:
        return "SGLANG_SIMULATE_ACC_LEN is set"
    return None


def build_round_graphs(worker, history=None) -> Optional[RoundGraphs]:
    """Capture the worker's greedy rounds, or log why not and return None (SGLang's path serves)."""
    reason = why_not_round_graphs(worker)
    if reason is not None:
        logger.info("DSPINE round graphs off: %s; every round takes SGLang's DFlash path.", reason)
        return None
    draft = worker.draft_model_runner.decode_cuda_graph_runner
    target = worker.target_worker.model_runner.decode_cuda_graph_runner
    sizes = sorted(set(draft.capture_bs) & set(target.capture_bs))
    if not sizes:
        logger.info("DSPINE round graphs off: the draft and target runners share no captured batch size.")
        return None
    from sglang.srt.speculative import dflash_utils

    sampled = (dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus
               if env.DSPINE_ROUND_GRAPH.get() == "all" and dflash_utils.is_dflash_sampling_verify_available()
               else None)
    graphs = RoundGraphs(worker, draft_runner=draft, target_runner=target, draft_sampler=worker._draft_sampler,
                         sizes=sizes, history=history, sampled_accept=sampled)
    try:
        graphs.capture()
    except Exception as exc:   # a kernel that syncs, a runner that differs: serve SGLang's path instead
        logger.warning("DSPINE round graphs could not be captured (%s: %s); every round takes SGLang's DFlash "
                       "path. Set %s=0 to skip the attempt.", type(exc).__name__, exc, env.DSPINE_ROUND_GRAPH.name)
        torch.cuda.synchronize()
        return None
    return graphs
