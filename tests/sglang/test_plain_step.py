"""The DSPINE worker's plain step and its speculation switch, against stand-ins for SGLang's runner
(CPU): what a plain step of one or K tokens feeds the target and the drafter's KV append, what it
returns in the DFlash format, that the width-1 backend is swapped in for the step only, and that the worker routes a
decode step to it when the switch says so.

Runs inside `.venv-sglang`; skips where SGLang is absent. The step on a real server (graphs, an H200)
is measured by dspine/bench/dynamic.py.
"""

from __future__ import annotations

import collections
import importlib.metadata
from types import SimpleNamespace

import pytest

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

import torch  # noqa: E402
from sglang.srt.speculative import dflash_worker_v2 as dflash  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from dspine.dynamic.cost_tables import SpsCostTable  # noqa: E402
from dspine.dynamic.switch import ServingSwitch, SwitchConfig  # noqa: E402
from dspine.sglang import plain_step  # noqa: E402
from dspine.sglang.dspine_worker_v2 import DSpineWorkerV2  # noqa: E402

BLOCK, VOCAB, HIDDEN = 4, 11, 6


class Runner:
    """The target's model runner: a verify backend and graph runner the plain step must swap out and back."""

    def __init__(self, req_to_token, graphs=None):
        self.attn_backend, self.decode_cuda_graph_runner = "verify-backend", graphs
        self.init_new_workspace = False
        self.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
        self.spec_algorithm = "DSPINE-algorithm"
        self.new_backends = []

    def _get_attention_backend(self, init_new_workspace=False):
        self.init_new_workspace = init_new_workspace      # SGLang's factory leaves the flag set
        self.new_backends.append(init_new_workspace)
        return "plain-backend"


class World:
    """A worker stand-in whose target worker 'samples' each row's least likely token (so the test can
    tell the worker's own sample from an argmax recomputed by the plain step)."""

    def __init__(self, bs=3, graphs=None):
        self.req_to_token = torch.arange(100, 100 + 8 * 40).view(8, 40)
        self.runner = Runner(self.req_to_token, graphs)
        self.logits = torch.randn(bs, VOCAB)
        self.hidden = torch.randn(bs, HIDDEN)
        self.seen = {}
        world = self

        def forward_batch_generation(batch, capture_hidden_mode=None):
            world.seen["call"] = {name: getattr(batch, name) for name in (
                "forward_mode", "input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc", "spec_info")}
            world.seen["capture_hidden_mode"] = capture_hidden_mode
            world.seen["backend"] = world.runner.attn_backend
            world.seen["graphs"] = world.runner.decode_cuda_graph_runner
            output = SimpleNamespace(next_token_logits=world.logits.clone(), hidden_states=world.hidden.clone(),
                                     customized_info=None)
            return SimpleNamespace(logits_output=output, can_run_cuda_graph=True,
                                   next_token_ids=world.logits.argmin(-1).to(torch.int32))

        self.worker = SimpleNamespace(
            block_size=BLOCK, model_runner=self.runner,
            target_worker=SimpleNamespace(model_runner=self.runner, forward_batch_generation=forward_batch_generation),
            _append_target_hidden_to_draft_kv_by_loc=lambda **kw: world.seen.setdefault("append", kw),
            _make_next_draft_input_decode=lambda **kw: ("next-draft-input", kw))

    def batch(self, sampling_info=None):
        seq_lens = torch.tensor([5, 17, 9])
        return SimpleNamespace(
            forward_mode="decode-as-scheduled", input_ids=None, out_cache_loc=None,
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), seq_lens_sum=31,
            req_pool_indices=torch.tensor([2, 0, 6]), sampling_info=sampling_info,
            spec_info=SimpleNamespace(bonus_tokens=torch.tensor([7, 8, 9], dtype=torch.int32)))


def test_one_plain_step_is_an_ar_decode_of_the_bonus_tokens():
    world = World()
    step = plain_step.PlainStep(world.worker)
    assert world.runner.new_backends == [True] and world.runner.init_new_workspace is False
    assert step.graph_runner is None                       # SGLang captured no graphs: neither do we
    batch, published = world.batch(), []
    spec_info = batch.spec_info
    result = step.run(batch, on_publish=published.append)

    call = world.seen["call"]
    assert call["forward_mode"] == dflash.ForwardMode.DECODE and call["spec_info"] is None
    assert call["input_ids"].tolist() == [7, 8, 9]
    assert call["seq_lens"].tolist() == [6, 18, 10]                  # kv length with the new token
    assert call["seq_lens_cpu"].tolist() == [6, 18, 10] and call["seq_lens_sum"] == 34
    slots = [int(world.req_to_token[2, 5]), int(world.req_to_token[0, 17]), int(world.req_to_token[6, 9])]
    assert call["out_cache_loc"].tolist() == slots
    assert world.seen["capture_hidden_mode"] == dflash.CaptureHiddenMode.FULL
    assert world.seen["backend"] == "plain-backend" and world.runner.attn_backend == "verify-backend"
    # the scheduler's view of the batch is back as it was
    assert batch.forward_mode == "decode-as-scheduled" and batch.spec_info is spec_info
    assert batch.seq_lens.tolist() == [5, 17, 9] and batch.seq_lens_cpu.tolist() == [5, 17, 9]
    assert batch.seq_lens_sum == 31

    sampled = world.logits.argmin(-1)
    assert result.next_token_ids.view(3, BLOCK)[:, 0].tolist() == sampled.tolist()
    assert result.next_token_ids.view(3, BLOCK)[:, 1:].eq(0).all()
    assert result.accept_lens.tolist() == [1, 1, 1] and result.speculative_num_draft_tokens == BLOCK
    assert result.new_seq_lens.tolist() == [6, 18, 10] and published[0].tolist() == [6, 18, 10]
    assert torch.equal(world.seen["append"]["target_hidden"], world.hidden)
    assert world.seen["append"]["cache_loc"].tolist() == slots
    assert world.seen["append"]["positions"].tolist() == [5, 17, 9]
    assert result.next_draft_input[1]["bonus_tokens"].tolist() == sampled.tolist()
    assert result.logits_output.hidden_states is None
    assert result.logits_output.customized_info == {"dspine_verify_tokens": [1, 1, 1]}


@pytest.mark.parametrize("host_lens", [True, False], ids=["seq_lens_cpu", "seq_lens_sum-only"])
def test_a_k_token_plain_step_chains_k_ar_decodes_and_appends_every_position(host_lens):
    """K = 3: each AR decode feeds the previous sample at the next slot and length (host lengths kept in
    step, whether the batch carries them per request or only their sum); the hidden states of all K
    positions reach the drafter's KV in one append (copied out of the graph's reused output buffer);
    the result commits K tokens per request."""
    world, calls = World(), []
    graph_hidden = torch.zeros(3, HIDDEN)                    # one output buffer, rewritten by every replay

    def forward_batch_generation(batch, capture_hidden_mode=None):
        calls.append({name: (value.clone() if torch.is_tensor(value) else value) for name, value in (
            (n, getattr(batch, n)) for n in ("forward_mode", "input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum",
                                             "out_cache_loc", "spec_info"))})
        graph_hidden.copy_(batch.seq_lens[:, None].float() + torch.arange(HIDDEN) / 10)
        sampled = (batch.input_ids * 3 + batch.seq_lens) % VOCAB
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=graph_hidden, customized_info=None),
                               can_run_cuda_graph=True, next_token_ids=sampled.to(torch.int32))

    world.worker.target_worker.forward_batch_generation = forward_batch_generation
    batch, published = world.batch(), []
    if not host_lens:
        batch.seq_lens_cpu = None
    result = plain_step.PlainStep(world.worker, tokens=3).run(batch, on_publish=published.append)

    prefix, rows = torch.tensor([5, 17, 9]), torch.tensor([2, 0, 6])
    expected_tokens, token = [], torch.tensor([7, 8, 9])
    for i, call in enumerate(calls):
        assert call["forward_mode"] == dflash.ForwardMode.DECODE and call["spec_info"] is None
        assert call["input_ids"].tolist() == token.tolist()
        assert call["seq_lens"].tolist() == (prefix + i + 1).tolist()
        host = call["seq_lens_cpu"]
        assert (host.tolist() == call["seq_lens"].tolist()) if host_lens else host is None
        assert call["seq_lens_sum"] == 31 + 3 * (i + 1)
        assert call["out_cache_loc"].tolist() == world.req_to_token[rows, prefix + i].tolist()
        token = (token * 3 + prefix + i + 1) % VOCAB
        expected_tokens.append(token)
    assert len(calls) == 3
    tokens = torch.stack(expected_tokens, dim=1)                                    # [bs, K]
    grid = result.next_token_ids.view(3, BLOCK)
    assert torch.equal(grid[:, :3], tokens) and grid[:, 3:].eq(0).all()
    assert result.accept_lens.tolist() == [3, 3, 3]
    assert result.new_seq_lens.tolist() == [8, 20, 12] and published[0].tolist() == [8, 20, 12]
    assert result.next_draft_input[1]["bonus_tokens"].tolist() == tokens[:, -1].tolist()
    append = world.seen["append"]
    positions = prefix[:, None] + torch.arange(3)
    assert append["positions"].tolist() == positions.reshape(-1).tolist()
    assert append["cache_loc"].tolist() == world.req_to_token[rows[:, None], positions].reshape(-1).tolist()
    expected_hidden = (positions + 1).reshape(-1, 1).float() + torch.arange(HIDDEN) / 10
    assert torch.equal(append["target_hidden"], expected_hidden)
    assert batch.seq_lens.tolist() == [5, 17, 9] and batch.seq_lens_sum == 31 and batch.input_ids is None


def test_plain_step_length_is_bounded_by_the_block():
    with pytest.raises(ValueError, match="must lie in"):
        plain_step.PlainStep(World().worker, tokens=BLOCK + 1)


def test_the_batch_is_restored_when_the_forward_fails():
    world = World()

    def fail(batch, capture_hidden_mode=None):
        raise RuntimeError("boom")

    world.worker.target_worker.forward_batch_generation = fail
    batch = world.batch()
    with pytest.raises(RuntimeError, match="boom"):
        plain_step.PlainStep(world.worker).run(batch)
    assert batch.forward_mode == "decode-as-scheduled" and batch.seq_lens.tolist() == [5, 17, 9]
    assert world.runner.attn_backend == "verify-backend"


def test_decode_graphs_are_captured_as_ar_with_full_hidden_capture():
    """The width-1 graphs: SGLang's runner class built while the algorithm reads as none (DECODE mode,
    not TARGET_VERIFY), keeping FULL hidden capture although the base class sets the server's mode."""
    built = {}

    class FakeGraphRunner:
        def __init__(self, model_runner, attn_backend=None):
            self.return_hidden_states_mode = dflash.CaptureHiddenMode.NULL    # what SGLang's base does
            built.update(algorithm=model_runner.spec_algorithm, backend=model_runner.attn_backend,
                         passed_backend=attn_backend, mode=self.return_hidden_states_mode)
            self.max_bs = 8

    world = World(graphs="verify-graphs")
    world.runner._decode_cuda_graph_runner_cls = lambda: FakeGraphRunner
    step = plain_step.PlainStep(world.worker)
    assert built == {"algorithm": SpeculativeAlgorithm.NONE, "backend": "plain-backend",
                     "passed_backend": "plain-backend", "mode": dflash.CaptureHiddenMode.FULL}
    assert world.runner.spec_algorithm == "DSPINE-algorithm"
    assert world.runner.decode_cuda_graph_runner == "verify-graphs"
    step.run(world.batch())
    assert world.seen["graphs"] is step.graph_runner and world.runner.decode_cuda_graph_runner == "verify-graphs"


def losing_switch() -> ServingSwitch:
    """One request, drafting predicted to lose: 2.5 ms per drafting step for 1.3 tokens vs 1 ms plain."""
    config = SwitchConfig(SpsCostTable((4,), (400.0,), 4), SpsCostTable((1,), (1000.0,), 1), None, (0.2, 0.1, 0.0))
    return ServingSwitch(config, BLOCK)


def test_worker_routes_decode_steps_by_the_switch(monkeypatch):
    """A decode step goes to the plain step while the switch says so, with the running requests' ids;
    a step with a grammar drafts; a landed confidence copy reaches the switch before it decides."""
    worker = DSpineWorkerV2.__new__(DSpineWorkerV2)
    calls = []
    worker._plain_step = SimpleNamespace(run=lambda batch, on_publish: calls.append(on_publish) or "plain-result")
    worker._switch = losing_switch()
    worker._pending_confidence = collections.deque([(["r0"], torch.full((1, 3), 5.0), None)])
    worker.draft_model = SimpleNamespace(ensure_transfer_table=lambda serving: None)
    worker._validate_phase1_sampling_support = lambda batch: None
    mode = SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)
    batch = SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, has_grammar=False, sampling_info=None,
                            reqs=[SimpleNamespace(rid="r0")], return_logprob=False)

    assert worker._drafts_this_step(batch) is True        # confident record observed first: drafting wins
    assert not worker._pending_confidence and worker._switch.expected["r0"] > 2.5
    worker._switch.expected.clear()                       # back to the losing prior
    assert worker.forward_batch_generation(batch, on_publish="publish") == "plain-result"
    assert calls == ["publish"] and worker._switch.plain == 1
    assert worker._drafts_this_step(SimpleNamespace(**{**vars(batch), "has_grammar": True})) is True
    # SGLANG_RECORD_STEP_TIME: consecutive plain steps are timed as plain periods at their batch size
    from dspine.sglang import step_clock

    clock = step_clock.DecodeStepClock()
    monkeypatch.setattr(step_clock, "CLOCK", clock)
    worker._record_steps = True
    worker.forward_batch_generation(batch, on_publish="publish")
    worker.forward_batch_generation(batch, on_publish="publish")
    assert clock.snapshot()["plain"][1][0] == 1 and clock.snapshot()["draft"] == {}
    penalised = SimpleNamespace(penalizer_orchestrator=SimpleNamespace(is_required=True))
    assert worker._drafts_this_step(SimpleNamespace(**{**vars(batch), "sampling_info": penalised})) is True


def test_confidence_copies_reach_the_switch_in_order_once_landed():
    """Copies in flight stay queued; landed ones are observed oldest first (a later step's values win);
    the queue keeps at most MAX_PENDING_CONFIDENCE steps."""
    from dspine.sglang import dspine_worker_v2 as worker_module

    class Event:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

    worker = DSpineWorkerV2.__new__(DSpineWorkerV2)
    worker._switch = losing_switch()
    later = Event(False)
    worker._pending_confidence = collections.deque([
        (["a"], torch.full((1, 3), -5.0), Event(True)), (["a"], torch.full((1, 3), 5.0), later)])
    worker._observe_pending_confidence()
    assert worker._switch.expected["a"] < 0.1 and len(worker._pending_confidence) == 1
    later.done = True
    worker._observe_pending_confidence()
    assert worker._switch.expected["a"] > 2.5 and not worker._pending_confidence

    worker.block_size = BLOCK
    worker.draft_model = SimpleNamespace(recorded_confidence=lambda n: torch.zeros(n, 3))
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="x")])
    result = SimpleNamespace(logits_output=SimpleNamespace(customized_info=None))
    for _ in range(worker_module.MAX_PENDING_CONFIDENCE + 2):
        worker._record_drafted_step(batch, result)
    assert len(worker._pending_confidence) == worker_module.MAX_PENDING_CONFIDENCE
    assert result.logits_output.customized_info == {"dspine_verify_tokens": [BLOCK]}
