"""`RoundGraphs.run` end to end on CPU, its five stages run eagerly: fake draft and target runners
(recording what `load_batch` was given, "replaying" a known drafter and target) stand in for
SGLang's captured forwards. Checked against greedy verification done by hand: the runners' inputs
(anchor, masks, positions, KV slots, padding rows), the committed tokens and lengths, the drafter-KV
append, the token history, and that a result survives the next round (the output ring)."""

import importlib.metadata
from types import SimpleNamespace

import pytest
import torch

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

from dspine.sglang.round_graph import RoundGraphs  # noqa: E402
from dspine.sglang.token_history import SlotTokenHistory  # noqa: E402

B, V, H, MASK = 4, 50, 6, 49


def successor(x):
    """The fake target's greedy continuation of token x."""
    return (x * 7 + 3) % (V - 1)


class FakeBackend:
    def __init__(self, replay):
        self._graphs, self._outputs, self.replay = {}, {}, replay

    def add(self, key, output):
        self._graphs[key] = SimpleNamespace(replay=self.replay)
        self._outputs[key] = output


class FakeRunner:
    """Records the batch `load_batch` got (as SGLang's runner copies it into its buffers)."""

    def __init__(self, role, replay, sizes, output=None):
        self.role, self.loaded = role, None
        self.backend = FakeBackend(replay)
        self.model_runner = SimpleNamespace(spec_algorithm=None)
        for n in sizes:
            self.backend.add((role, n), output(n) if output else None)

    def load_batch(self, fb):
        self.loaded = {k: getattr(fb, k).clone() for k in ("input_ids", "positions", "out_cache_loc",
                                                          "req_pool_indices", "seq_lens")}
        if fb.input_embeds is not None:
            self.loaded["input_embeds"] = fb.input_embeds.clone()
        self._replay_graph_key = (self.role, fb.batch_size)


def build(sizes, wrong_at, window=None, sampled_accept=None):
    """A RoundGraphs over fakes. The drafter proposes the target's continuation chain from the anchor,
    except row r's proposal at position wrong_at[r] (1-based; B = none wrong). `window`: a draft
    window (DFlash's compact rows; the fake rebuild records its arguments in `rebuilt`)."""
    req_to_token = torch.zeros((6, 64), dtype=torch.int32)
    for slot in range(1, 6):                       # slot 0: SGLang's padding row, all zeros
        req_to_token[slot] = torch.arange(64, dtype=torch.int32) + 100 * slot
    embed = torch.nn.Embedding(V, H)
    appended, rebuilt = [], []
    worker = SimpleNamespace(
        use_compact_draft_cache=window is not None,
        _compute_compact_draft_seq_lens=lambda lens: lens.clamp(max=window or 0).to(torch.int32),
        _rebuild_compact_draft_cache=lambda **kw: rebuilt.append(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}),
        block_size=B, _mask_token_id=MASK, device=torch.device("cpu"), _draft_block_spec_info=None,
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
            model=SimpleNamespace(get_input_embeddings=lambda: embed))),
        _append_target_hidden_to_draft_kv_by_loc=lambda **kw: appended.append(
            {k: v.clone() for k, v in kw.items()}),
        _make_next_draft_input_decode=lambda bonus_tokens, new_seq_lens: SimpleNamespace(
            bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens))
    sampler = SimpleNamespace(out=torch.zeros(max(sizes) * (B - 1), dtype=torch.int64))
    outputs = {}

    def draft_replay():
        ids = draft.loaded["input_ids"].view(-1, B)
        n = ids.shape[0]
        proposals = torch.zeros((n, B - 1), dtype=torch.int64)
        for row in range(n):
            token = int(ids[row, 0])
            for j in range(B - 1):
                token = successor(token)
                proposals[row, j] = token if j + 1 != wrong_at.get(row, B) else (token + 1) % (V - 1)
        sampler.out[: n * (B - 1)] = proposals.view(-1)

    def target_output(n):
        outputs[n] = SimpleNamespace(next_token_logits=torch.zeros((n * B, V)), hidden_states=torch.zeros((n * B, 3)))
        return outputs[n]

    def target_replay():
        ids = target.loaded["input_ids"]
        n = ids.numel() // B
        out = outputs[n]
        out.next_token_logits.zero_()
        out.next_token_logits[torch.arange(n * B), successor(ids)] = 1.0
        out.hidden_states.copy_(ids.to(torch.float32)[:, None].expand(-1, 3))

    draft = FakeRunner("draft", draft_replay, sizes)
    target = FakeRunner("target", target_replay, sizes, output=target_output)
    history = SlotTokenHistory(pool_rows=6, max_context_len=64, block_size=B, window=16, max_bs=max(sizes),
                               device="cpu")
    graphs = RoundGraphs(worker, draft_runner=draft, target_runner=target, draft_sampler=sampler, sizes=sizes,
                         history=history, sampled_accept=sampled_accept)
    for n in graphs.sizes:                         # the stages run eagerly in place of their graphs
        graphs._runner_keys[("draft", n)], graphs._runner_keys[("target", n)] = ("draft", n), ("target", n)
        graphs._graphs.update({(name, n): fn for name, fn in graphs.stages(n).items()})
    graphs.rebuilt = rebuilt
    return graphs, draft, target, appended, history, embed


def run_round(graphs, batch):
    return graphs.run(batch, graphs.kind_for(batch))


def decode_batch(slots, seq_lens, anchors):
    return SimpleNamespace(reqs=[object()] * len(slots), req_pool_indices=torch.tensor(slots),
                           seq_lens=torch.tensor(seq_lens), spec_info=SimpleNamespace(bonus_tokens=torch.tensor(anchors)),
                           sampling_info=None, out_cache_loc=None)


def test_a_padded_round_commits_what_greedy_verification_commits():
    graphs, draft, target, appended, history, embed = build([1, 2, 4], wrong_at={0: 2, 2: 1})
    slots, lens, anchors = [3, 1, 5], [10, 4, 7], [11, 12, 13]
    result = run_round(graphs, decode_batch(slots, lens, anchors))

    # The drafter saw anchor + masks at positions seq_len.., in the rows' KV slots; row 3 is padding.
    ids = draft.loaded["input_ids"].view(4, B)
    assert ids[:3, 0].tolist() == anchors and (ids[:3, 1:] == MASK).all()
    assert draft.loaded["positions"].view(4, B)[:3].tolist() == [list(range(s, s + B)) for s in lens]
    assert draft.loaded["out_cache_loc"].view(4, B)[:3].tolist() == [
        [100 * slot + s + j for j in range(B)] for slot, s in zip(slots, lens)]
    assert draft.loaded["req_pool_indices"].tolist() == slots + [0]
    assert draft.loaded["seq_lens"].tolist() == lens + [1]
    assert (draft.loaded["out_cache_loc"].view(4, B)[3] == 0).all()          # padded writes go to slot 0
    torch.testing.assert_close(draft.loaded["input_embeds"], embed(ids.view(-1)))
    assert target.loaded["input_ids"].view(4, B)[:, 0].tolist() == anchors + [0]

    # Greedy verification by hand: chains from each anchor; row 0 wrong at proposal 2, row 2 at 1.
    expected_commit = [2, B, 1]
    tokens = result.next_token_ids.view(3, B)
    for row, (anchor, commit) in enumerate(zip(anchors, expected_commit)):
        chain, token = [], anchor
        for _ in range(commit):
            token = successor(token)
            chain.append(token)
        assert tokens[row, :commit].tolist() == chain
        assert int(result.next_draft_input.bonus_tokens[row]) == chain[-1]
    assert result.accept_lens.tolist() == expected_commit
    assert result.new_seq_lens.tolist() == [s + c for s, c in zip(lens, expected_commit)]
    assert result.speculative_num_draft_tokens == B and result.can_run_cuda_graph

    # Drafter KV: the target hidden of all 4 x B verify rows, with each row's commit length.
    kv = appended[-1]
    assert kv["commit_lens"].tolist()[:3] == expected_commit
    assert kv["cache_loc_2d"].tolist() == draft.loaded["out_cache_loc"].view(4, B).tolist()
    # Token history: anchor at seq_len, then the committed tokens.
    for row, (slot, start, commit) in enumerate(zip(slots, lens, expected_commit)):
        assert history.ids[slot, start + 1: start + 1 + commit].tolist() == tokens[row, :commit].tolist()


def test_a_result_survives_the_next_round():
    graphs, *_ = build([1, 2], wrong_at={})
    first = run_round(graphs, decode_batch([2], [5], [7]))
    kept = first.next_token_ids.clone(), first.new_seq_lens.clone()
    second = run_round(graphs, decode_batch([2, 4], [9, 3], [8, 9]))
    assert first.next_token_ids.tolist() == kept[0].tolist() and first.new_seq_lens.tolist() == kept[1].tolist()
    assert second.new_seq_lens.tolist() == [9 + B, 3 + B]


def test_batches_past_the_largest_size_or_not_greedy_are_refused():
    graphs, *_ = build([1, 2], wrong_at={})
    assert graphs.kind_for(decode_batch([1, 2], [3, 3], [1, 1]))
    assert not graphs.kind_for(decode_batch([1, 2, 3], [3, 3, 3], [1, 1, 1]))
    sampled = decode_batch([1], [3], [1])
    sampled.sampling_info = SimpleNamespace(is_all_greedy=False)
    assert not graphs.kind_for(sampled)


def test_the_reason_rounds_are_not_captured_is_named(monkeypatch):
    from dspine.sglang.round_graph import why_not_round_graphs

    worker = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.setenv("DSPINE_ROUND_GRAPH", "0")
    assert why_not_round_graphs(worker) == "DSPINE_ROUND_GRAPH=0"
    monkeypatch.setenv("DSPINE_ROUND_GRAPH", "1")
    assert why_not_round_graphs(worker) == "not a CUDA device"


def test_with_a_draft_window_the_drafter_sees_clamped_lengths_and_rebuilt_rows():
    graphs, draft, target, *_ = build([1, 2, 4], wrong_at={}, window=6)
    run_round(graphs, decode_batch([3, 1, 5], [10, 4, 7], [11, 12, 13]))
    assert draft.loaded["seq_lens"].tolist() == [6, 4, 6, 1]                   # min(seq_len, window); padding 1
    assert target.loaded["seq_lens"].tolist() == [10, 4, 7, 1]                 # the target sees everything
    rebuild = graphs.rebuilt[-1]
    assert rebuild["bs"] == 4 and rebuild["block_size"] == B
    assert rebuild["draft_prefix_lens"].tolist() == [6, 4, 6, 1] and rebuild["prefix_lens"].tolist() == [10, 4, 7, 1]
    assert rebuild["verify_out_cache_loc_2d"].tolist() == draft.loaded["out_cache_loc"].view(4, B).tolist()


def test_start_up_runs_every_sampling_kernel_sglang_would_build_on_first_use(monkeypatch, caplog):
    from sglang.srt.layers import sampler
    from sglang.srt.speculative import dflash_utils

    from dspine.sglang.warmup import warm_sampling_kernels

    calls = []

    def fake(name, fail=False):
        def run(probs, *args, **kwargs):
            calls.append((name, tuple(probs.shape)))
            if fail:
                raise RuntimeError("nvcc missing")
        return run

    monkeypatch.setattr(dflash_utils, "top_k_renorm_prob", fake("top_k"), raising=False)
    monkeypatch.setattr(dflash_utils, "top_p_renorm_prob", fake("top_p", fail=True), raising=False)
    monkeypatch.setattr(sampler, "top_k_top_p_sampling_from_probs", fake("top_k_top_p"), raising=False)
    monkeypatch.setattr(sampler, "min_p_sampling_from_probs", None, raising=False)     # absent in this build
    warm_sampling_kernels(11, "cpu")
    assert calls == [("top_k", (2, 11)), ("top_p", (2, 11)), ("top_k_top_p", (2, 11))]
    assert "top_p_renorm_prob failed (RuntimeError: nvcc missing)" in caplog.text


def test_a_sampled_round_reads_the_batch_sampling_rows_and_commits_dflash_sampled_accept():
    seen = {}

    def sampled_accept(*, candidates, next_token_logits, sampling_info, use_sparse_topk):
        """Stands in for DFlash's sampled verify: records its inputs, accepts row r's first r proposals."""
        seen.update(candidates=candidates.clone(), rows=next_token_logits.shape[0], sparse=use_sparse_topk,
                    temperatures=sampling_info.temperatures.clone(), top_ks=sampling_info.top_ks.clone(),
                    top_ps=sampling_info.top_ps.clone(), need=(sampling_info.need_top_k_sampling,
                                                               sampling_info.need_top_p_sampling))
        n = candidates.shape[0]
        return torch.arange(n) % B, torch.full((n,), 42)

    graphs, draft, target, appended, history, _ = build([1, 2, 4], wrong_at={}, sampled_accept=sampled_accept)
    batch = decode_batch([3, 1, 5], [10, 4, 7], [11, 12, 13])
    batch.sampling_info = SimpleNamespace(
        is_all_greedy=False, temperatures=torch.tensor([[0.7], [1.0], [1.0]]), top_ks=torch.tensor([20, 1, 1 << 30]),
        top_ps=torch.tensor([0.9, 1.0, 0.95]), logit_bias=None, acc_additive_penalties=None)
    assert graphs.kind_for(batch) == "sampled"
    result = run_round(graphs, batch)
    assert seen["sparse"] is False and seen["need"] == (True, True) and seen["rows"] == 4 * B
    assert seen["temperatures"].view(-1).tolist() == pytest.approx([0.7, 1.0, 1.0, 1.0])   # padding row: 1
    assert seen["top_ks"].tolist() == [20, 1, 1 << 30, 1] and seen["top_ps"].tolist() == pytest.approx([0.9, 1, 0.95, 1])
    assert torch.equal(seen["candidates"], target.loaded["input_ids"].view(4, B))
    assert result.accept_lens.tolist() == [1, 2, 3]                                 # accepted + 1
    tokens = result.next_token_ids.view(3, B)
    for row in range(3):                                                           # proposals, then the bonus
        assert tokens[row, :row].tolist() == seen["candidates"][row, 1: row + 1].tolist()
        assert int(tokens[row, row]) == 42
    assert result.new_seq_lens.tolist() == [11, 6, 10]
    assert appended[-1]["commit_lens"].tolist()[:3] == [1, 2, 3]
    greedy = decode_batch([2], [5], [7])
    assert graphs.kind_for(greedy) == "greedy" and run_round(graphs, greedy).accept_lens.tolist() == [B]
