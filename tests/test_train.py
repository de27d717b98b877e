"""Trainer: losses fall on real batches, time-limited runs resume, the export is a valid checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from dspine.model.checkpoint import load_checkpoint
from dspine.train.blocks import make_block_batch
from dspine.train.trainer import TrainConfig, train


def test_block_batch_masks_and_labels():
    recs = [{"ids": list(range(100, 130)), "answer_start": 10}, {"ids": list(range(200, 220)), "answer_start": 5}]
    b = make_block_batch(recs, block_size=4, blocks_per_seq=3, window=6, max_len=64,
                         generator=torch.Generator().manual_seed(0))
    assert b.labels.shape == (6, 3) and b.mask.shape == (2, 12, 30 + 12)
    for row in range(2):
        for k in range(3):
            a = int(b.anchors[row, k])
            assert a >= recs[row]["answer_start"]
            ids = recs[row]["ids"]
            want = [ids[a + j] if a + j < len(ids) else -100 for j in range(1, 4)]
            assert b.labels[row * 3 + k].tolist() == want
            q = k * 4  # first query slot of block k
            ctx = b.mask[row, q, :30].nonzero().flatten().tolist()
            assert ctx == [j for j in range(max(0, a - 6), a) if j < len(ids)]
            blk = b.mask[row, q, 30:].nonzero().flatten().tolist()
            assert blk == list(range(k * 4, k * 4 + 4))


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspine.engine.targets import load_target

    _, tokenizer = load_target()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, initializer_range=0.3)
    path = tmp_path_factory.mktemp("tiny_target")
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _config(tmp_path, target_dir, steps, **kw):
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for i in range(12):  # a small corpus the drafter can fit: repeated patterns
            base = torch.randint(20, 400, (6,), generator=g).tolist()
            f.write(json.dumps({"ids": [1, 2, 3] + base * 5, "answer_start": 3}) + "\n")
    return TrainConfig(data=str(data), run_dir=str(tmp_path / "run"), target=str(target_dir), steps=steps,
                       batch_size=4, blocks_per_seq=4, max_len=64, warmup_steps=2, lr=1e-2, heldout_sequences=2,
                       eval_every=10, save_every=5, log_every=5,
                       drafter=dict(intermediate_size=64, transfer_rank=16, block_size=4, sliding_window=32,
                                    injection_top_k=4, selection_top_k=4, successor_table_size=4), **kw)


def test_training_reduces_loss_resumes_and_exports(tmp_path, tiny_target_dir):
    cfg = _config(tmp_path, tiny_target_dir, steps=30)
    assert train(cfg, device="cpu", time_limit_s=0.0, progress=False) is None       # stopped at once
    assert (tmp_path / "run" / "state.pt").exists()
    export = train(cfg, device="cpu", progress=False)                                 # resumes, finishes
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log[0]["step"] == 5 and log[-1]["step"] == 30 and "heldout_tau" in log[-1]
    assert log[-1]["final"] < log[0]["final"] - 0.5
    for key in ("transition", "layers", "confidence"):
        assert key in log[-1]
    model = load_checkpoint(export)
    assert model.config.block_size == 4 and model.config.injection


def test_profile_reports_the_step_and_touches_no_run_dir(tmp_path, tiny_target_dir):
    from dspine.train.profile import profile_training

    cfg = _config(tmp_path, tiny_target_dir, steps=30)
    report = profile_training(cfg, device="cpu", steps=1, warmup=1, rows=10)
    assert report.startswith("dspine train --profile-steps 1: ") and "ms per step" in report
    assert "aten::" in report and "Self CPU time total" in report  # the operator table
    assert not (tmp_path / "run").exists()


def test_heldout_tau_gives_no_free_acceptances_past_the_sequence_end(monkeypatch):
    """With an oracle selection every slot with a label is accepted, so a block whose only label is
    the last answer token scores 1 + 1: slots past the end must stop the count, not extend it."""
    from conftest import drafter_for, tiny_llama

    import dspine.train.trainer as trainer

    target = tiny_llama()
    drafter = drafter_for(target, block_size=8)

    def oracle(logits, anchors, temperature, **_):
        return type("Selected", (), {"tokens": oracle.labels.clamp(min=0)})()  # a real token everywhere

    real_make = trainer.make_block_batch

    def make_and_remember(*args, **kwargs):
        batch = real_make(*args, **kwargs)
        oracle.labels = batch.labels
        return batch

    monkeypatch.setattr(trainer, "select_tokens", oracle)
    monkeypatch.setattr(trainer, "make_block_batch", make_and_remember)
    records = [{"ids": list(range(10, 20)), "answer_start": 8}, {"ids": list(range(30, 40)), "answer_start": 8}]
    cfg = TrainConfig(data="unused", run_dir="unused", batch_size=2, blocks_per_seq=3, max_len=64)
    assert trainer.heldout_tau(drafter, target, records, cfg, "cpu") == 2.0
    long_records = [{"ids": list(range(10, 40)), "answer_start": 2}]
    assert trainer.heldout_tau(drafter, target, long_records, cfg, "cpu") > 2.0  # full blocks do score more
