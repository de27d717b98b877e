"""dspine/train/distributed.py: rank shards, gradient accumulation and two gloo processes give the
loss and gradients of the global batch taken as one batch; `dspine train` runs under torchrun."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import torch

from dspine.train import distributed
from dspine.train.blocks import BlockBatch, make_block_batch
from dspine.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[1]


def test_sampler_shards_are_disjoint_epochs_complete_and_positions_reproducible():
    records = [{"ids": [i]} for i in range(50)]
    streams = [distributed.SequenceSampler(records, seed=4, rank=r, world=3) for r in range(3)]
    shards = [{rec["ids"][0] for rec in s.shard} for s in streams]
    assert set.union(*shards) == set(range(50)) and sum(map(len, shards)) == 50        # disjoint, complete
    first = [rec["ids"][0] for rec in streams[1].take(0, 17)]
    assert sorted(first) == sorted(shards[1])                                          # epoch 0: each once
    assert first != sorted(first)                                                       # shuffled
    resumed = distributed.SequenceSampler(records, seed=4, rank=1, world=3)             # a new process
    assert resumed.take(30, 8) == streams[1].take(30, 8)
    assert torch.equal(torch.randint(0, 99, (5,), generator=resumed.generator(30)),
                       torch.randint(0, 99, (5,), generator=streams[1].generator(30)))
    assert streams[0].take(0, 10) != distributed.SequenceSampler(records, seed=5, rank=0, world=3).take(0, 10)


def test_length_grouping_sorts_runs_of_an_epoch_and_keeps_its_records():
    """group = 8: each run of 8 positions of an epoch holds the same records as without grouping,
    sorted by length; an epoch still takes every record once; group 1 is the plain order."""
    g = random.Random(0)
    records = [{"ids": [i] * g.randint(1, 40)} for i in range(45)]
    plain = distributed.SequenceSampler(records, seed=2, rank=0, world=1)
    grouped = distributed.SequenceSampler(records, seed=2, rank=0, world=1, group=8)
    assert distributed.SequenceSampler(records, seed=2, rank=0, world=1, group=1).take(0, 45) == plain.take(0, 45)
    for start in [e * 45 + k for e in (0, 1) for k in range(0, 45, 8)]:   # two epochs; each ends on a short run
        count = min(8, 45 - start % 45)
        a, b = plain.take(start, count), grouped.take(start, count)
        assert sorted(r["ids"][0] for r in a) == sorted(r["ids"][0] for r in b)
        assert [len(r["ids"]) for r in b] == sorted(len(r["ids"]) for r in b)
    assert sorted(r["ids"][0] for r in grouped.take(45, 45)) == list(range(45))
    assert [len(r["ids"]) for r in grouped.take(0, 45)] != sorted(len(r["ids"]) for r in records)  # runs, not all


def _split(batch: BlockBatch, rows: slice) -> BlockBatch:
    """Sequences `rows` of `batch` (and their blocks), padding unchanged."""
    nb = batch.anchors.shape[1]
    blocks = slice(rows.start * nb, rows.stop * nb)
    return BlockBatch(batch.input_ids[rows], batch.valid[rows], batch.anchors[rows], batch.anchor_ids[rows],
                      batch.block_positions[rows], batch.labels[blocks], batch.block_size, batch.window)


def _setup(seed: int = 0):
    """A tiny target, a drafter, its objective and a global batch of 4 sequences."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import tiny_llama

    from dspine.train.trainer import build_drafter, make_objective

    target = tiny_llama()
    cfg = TrainConfig(data="unused", run_dir="unused", drafter=dict(
        block_size=4, sliding_window=32, transfer_rank=16, injection_top_k=4, selection_top_k=4,
        successor_table_size=4, intermediate_size=64))
    torch.manual_seed(seed)
    model, _ = build_drafter(cfg, target, 3, "cpu")
    g = torch.Generator().manual_seed(1)
    records = [{"ids": torch.randint(4, 256, (n,), generator=g).tolist(), "answer_start": 3} for n in (30, 17, 24, 12)]
    batch = make_block_batch(records, block_size=4, blocks_per_seq=3, window=32, max_len=64, generator=g)
    return target, model, make_objective(model, cfg), cfg, batch


def _gradients(objective, target, batches, cfg):
    from dspine.train.trainer import accumulate_gradients

    terms = accumulate_gradients(objective, target, batches, cfg, use_amp=False)
    model = distributed.unwrap(objective).drafter
    return terms, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradient_accumulation_equals_one_batch():
    target, model, objective, cfg, batch = _setup()
    want_terms, want = _gradients(objective, target, [batch], cfg)
    model.zero_grad(set_to_none=True)
    terms, got = _gradients(objective, target, [_split(batch, slice(0, 1)), _split(batch, slice(1, 4))], cfg)
    assert got.keys() == want.keys() and len(got) > 10
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    for name in want_terms:
        torch.testing.assert_close(terms[name], want_terms[name], rtol=1e-5, atol=1e-6, msg=name)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    ctx, _ = distributed.setup("cpu")
    target, _, objective, cfg, batch = _setup(seed=rank)        # DDP broadcasts rank 0's weights
    mine = _split(batch, slice(0, 3)) if rank == 0 else _split(batch, slice(3, 4))   # unequal shares
    terms, grads = _gradients(objective, target, [mine], cfg)
    summed = {k: ctx.all_sum(v.clone()) for k, v in terms.items()}
    torch.save({"terms": summed, "grads": grads}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_two_gloo_processes_equal_one_process_on_the_global_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    target, _, objective, cfg, batch = _setup()
    want_terms, want = _gradients(objective, target, [batch], cfg)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["grads"].keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got["grads"][name], want[name], rtol=1e-4, atol=1e-6, msg=name)
        for name in want_terms:
            torch.testing.assert_close(got["terms"][name], want_terms[name], rtol=1e-5, atol=1e-6, msg=name)


def test_dspine_train_runs_under_torchrun(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(10):
            f.write(json.dumps({"ids": torch.randint(4, 256, (24,), generator=g).tolist(), "answer_start": 4}) + "\n")
    config = tmp_path / "tiny.yaml"
    config.write_text("steps: 4\nbatch_size: 2\nblocks_per_seq: 2\nmax_len: 32\nheldout_sequences: 2\n"
                      "log_every: 2\neval_every: 4\nsave_every: 2\ngrad_accum_steps: 2\n"
                      "drafter: {block_size: 4, sliding_window: 16, transfer_rank: 8, intermediate_size: 32,\n"
                      "          injection_top_k: 4, selection_top_k: 4, successor_table_size: 4}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "dspine.cli", "train", str(config), "--data", str(tmp_path / "data.jsonl"),
                           "--run-dir", str(tmp_path / "run"), "--target", f"random:{tmp_path / 'target'}",
                           "--device", "cpu", "-q"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert [e["step"] for e in log] == [2, 4] and "heldout_tau" in log[-1]
    assert all(e["label_tokens_per_s"] > 0 and e["mfu"] is None for e in log)
    assert (tmp_path / "run" / "checkpoint" / "config.json").exists()
    extra = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())
    assert "world_size" in json.dumps(extra) and proc.stdout.count("exported") == 1      # rank 0 alone exports
