"""The DSPINE worker's plain step and its speculation switch, against stand-ins for SGLang's runner
(CPU): what one plain step feeds the target and the drafter's KV append, what it returns in the
DFlash format, that the width-1 backend is swapped in for the step only, and that the worker routes a
decode step to it when the switch says so.

Runs inside `.venv-sglang`; skips where SGLang is absent. The step on a real server (graphs, an H200)
is measured by scripts/bench_dynamic.py.
"""

from __future__ import annotations

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

from dspine.dynamic_verification import SpsCostTable  # noqa: E402
from dspine.serving_switch import ServingSwitch, SwitchConfig  # noqa: E402
from dspine.sglang import plain_step  # noqa: E402
from dspine.sglang.worker import DSpineWorkerV2  # noqa: E402

BLOCK, VOCAB, HIDDEN = 4, 11, 6


class Runner:
    """The target's model runner: a verify backend and graph runner the plain step must swap out and back."""

    def __init__(self, req_to_token):
        self.attn_backend, self.decode_cuda_graph_runner = "verify-backend", None
        self.init_new_workspace = False
        self.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
        self.new_backends = []

    def _get_attention_backend(self, init_new_workspace=False):
        self.init_new_workspace = init_new_workspace      # SGLang's factory leaves the flag set
        self.new_backends.append(init_new_workspace)
        return "plain-backend"


class World:
    """A worker stand-in with a target whose logits and hidden states are fixed per row."""

    def __init__(self, bs=3):
        self.req_to_token = torch.arange(100, 100 + 8 * 40).view(8, 40)
        self.runner = Runner(self.req_to_token)
        self.logits = torch.randn(bs, VOCAB)
        self.hidden = torch.randn(bs, HIDDEN)
        self.seen = {}
        world = self

        class VerifyInput:
            def __init__(self, **kwargs):
                world.seen["verify_input"] = kwargs

            def prepare_for_verify(self, batch, target_worker):
                world.seen["backend_at_prepare"] = world.runner.attn_backend
                world.seen["host_lens_at_prepare"] = batch.seq_lens_cpu.clone()
                return "forward-batch", False

        def forward_batch_generation(**kwargs):
            world.seen["forward"] = kwargs
            world.seen["backend_at_forward"] = world.runner.attn_backend
            output = SimpleNamespace(next_token_logits=world.logits.clone(), hidden_states=world.hidden.clone(),
                                     customized_info=None)
            return SimpleNamespace(logits_output=output, can_run_cuda_graph=False)

        self.VerifyInput = VerifyInput
        self.worker = SimpleNamespace(
            block_size=BLOCK, model_runner=self.runner,
            target_worker=SimpleNamespace(model_runner=self.runner, forward_batch_generation=forward_batch_generation),
            _append_target_hidden_to_draft_kv_by_loc=lambda **kw: world.seen.setdefault("append", kw),
            _make_next_draft_input_decode=lambda **kw: ("next-draft-input", kw))

    def batch(self, sampling_info=None):
        seq_lens = torch.tensor([5, 17, 9])
        return SimpleNamespace(
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(), seq_lens_sum=31,
            req_pool_indices=torch.tensor([2, 0, 6]), sampling_info=sampling_info,
            spec_info=SimpleNamespace(bonus_tokens=torch.tensor([7, 8, 9], dtype=torch.int32), max_top_k=None,
                                      uniform_top_k_value=None))


def test_one_plain_step(monkeypatch):
    world = World()
    monkeypatch.setattr(dflash, "DFlashVerifyInput", world.VerifyInput)
    step = plain_step.PlainStep(world.worker)
    assert world.runner.new_backends == [True] and world.runner.init_new_workspace is False
    assert step.graph_runner is None                       # SGLang captured no graphs: neither do we
    batch, published = world.batch(), []
    result = step.run(batch, on_publish=published.append)

    seen = world.seen
    assert seen["verify_input"]["draft_token_num"] == 1
    assert seen["verify_input"]["draft_token"].tolist() == [7, 8, 9]
    assert seen["verify_input"]["positions"].tolist() == [5, 17, 9]
    slots = [int(world.req_to_token[2, 5]), int(world.req_to_token[0, 17]), int(world.req_to_token[6, 9])]
    assert batch.out_cache_loc.tolist() == slots
    assert seen["backend_at_prepare"] == seen["backend_at_forward"] == "plain-backend"
    assert world.runner.attn_backend == "verify-backend"   # restored after the step
    assert seen["host_lens_at_prepare"].tolist() == [6, 18, 10] and batch.seq_lens_cpu.tolist() == [5, 17, 9]
    assert seen["forward"]["is_verify"] and seen["forward"]["skip_attn_backend_init"]

    greedy = world.logits.argmax(-1)
    assert result.next_token_ids.view(3, BLOCK)[:, 0].tolist() == greedy.tolist()
    assert result.next_token_ids.view(3, BLOCK)[:, 1:].eq(0).all()
    assert result.accept_lens.tolist() == [1, 1, 1] and result.speculative_num_draft_tokens == BLOCK
    assert result.new_seq_lens.tolist() == [6, 18, 10] and published[0].tolist() == [6, 18, 10]
    assert torch.equal(seen["append"]["target_hidden"], world.hidden)
    assert seen["append"]["cache_loc"].tolist() == slots and seen["append"]["positions"].tolist() == [5, 17, 9]
    assert result.next_draft_input[1]["bonus_tokens"].tolist() == greedy.tolist()
    assert result.logits_output.hidden_states is None
    assert result.logits_output.customized_info == {"dspine_plain_steps": [1, 1, 1]}


def test_verify_adjustments_come_before_the_choice(monkeypatch):
    """A penalty that the verify applies (here: forbid each row's argmax) decides the plain token too."""
    world = World()
    monkeypatch.setattr(dflash, "DFlashVerifyInput", world.VerifyInput)
    forbidden = world.logits.argmax(-1)

    def penalise(*, next_token_logits, sampling_info, draft_token_num):
        assert draft_token_num == 1
        next_token_logits[torch.arange(3), forbidden] = -1e9

    monkeypatch.setattr(dflash, "apply_dflash_verify_logits_adjustments", penalise)
    result = plain_step.PlainStep(world.worker).run(world.batch(SimpleNamespace(is_all_greedy=True)))
    expected = world.logits.clone()
    expected[torch.arange(3), forbidden] = -1e9
    assert result.next_token_ids.view(3, BLOCK)[:, 0].tolist() == expected.argmax(-1).tolist()


def losing_switch() -> ServingSwitch:
    """One request, drafting predicted to lose: 2.5 ms per drafting step for 1.3 tokens vs 1 ms plain."""
    config = SwitchConfig(SpsCostTable((4,), (400.0,), 4), SpsCostTable((1,), (1000.0,), 1), None, (0.2, 0.1, 0.0))
    return ServingSwitch(config, BLOCK)


def test_worker_routes_decode_steps_by_the_switch():
    """A decode step goes to the plain step while the switch says so, with the running requests' ids;
    a step with a grammar drafts; a landed confidence copy reaches the switch before it decides."""
    worker = DSpineWorkerV2.__new__(DSpineWorkerV2)
    calls = []
    worker._plain_step = SimpleNamespace(run=lambda batch, on_publish: calls.append(on_publish) or "plain-result")
    worker._switch = losing_switch()
    worker._pending_confidence = (["r0"], torch.full((1, 3), 5.0), None)
    worker.draft_model = SimpleNamespace(ensure_transfer_table=lambda serving: None)
    worker._validate_phase1_sampling_support = lambda batch: None
    mode = SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)
    batch = SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, has_grammar=False,
                            reqs=[SimpleNamespace(rid="r0")], return_logprob=False)

    assert worker._drafts_this_step(batch) is True        # confident record observed first: drafting wins
    assert worker._pending_confidence is None and worker._switch.expected["r0"] > 2.5
    worker._switch.expected.clear()                       # back to the losing prior
    assert worker.forward_batch_generation(batch, on_publish="publish") == "plain-result"
    assert calls == ["publish"] and worker._switch.plain == 1
    assert worker._drafts_this_step(SimpleNamespace(**{**vars(batch), "has_grammar": True})) is True
