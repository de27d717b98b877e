"""Trainer: losses fall on real batches, time-limited runs resume, the export is a valid checkpoint."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dspine.model.checkpoint import load_checkpoint
from dspine.train.blocks import make_block_batch
from dspine.train.config import TrainConfig
from dspine.train.trainer import train


def test_block_batch_masks_and_labels():
    recs = [{"ids": list(range(100, 130)), "answer_start": 10}, {"ids": list(range(200, 220)), "answer_start": 5}]
    b = make_block_batch(recs, block_size=4, blocks_per_seq=3, window=6, max_len=64,
                         generator=torch.Generator().manual_seed(0), length_multiple=16)
    assert b.input_ids.shape == (2, 32) and not b.valid[0, 30:].any()                   # padded to 2 x 16
    assert b.labels.shape == (6, 3) and b.mask.shape == (2, 12, 32 + 12)
    for row in range(2):
        for k in range(3):
            a = int(b.anchors[row, k])
            assert a >= recs[row]["answer_start"]
            ids = recs[row]["ids"]
            want = [ids[a + j] if a + j < len(ids) else -100 for j in range(1, 4)]
            assert b.labels[row * 3 + k].tolist() == want
            q = k * 4  # first query slot of block k
            ctx = b.mask[row, q, :32].nonzero().flatten().tolist()
            assert ctx == [j for j in range(max(0, a - 6), a) if j < len(ids)]
            blk = b.mask[row, q, 32:].nonzero().flatten().tolist()
            assert blk == list(range(k * 4, k * 4 + 4))


@pytest.mark.parametrize("length_multiple", [1, 64, 128])
def test_block_mask_is_the_dense_mask_and_lists_exactly_the_tiles_it_needs(length_multiple):
    """`BlockBatch.block_mask` against `mask`: its mask function gives every entry of the dense mask,
    and each query tile lists exactly the key tiles where the dense mask has an entry (tiles of 32
    here, so rows cross several, and slots of one tile straddle two key tiles when L % 32 != 0)."""
    from torch.nn.attention.flex_attention import create_mask

    g = torch.Generator().manual_seed(length_multiple)
    recs = [{"ids": torch.randint(5, 900, (n,), generator=g).tolist(), "answer_start": n // 3}
            for n in (40, 333, 170, 97)]
    b = make_block_batch(recs, block_size=8, blocks_per_seq=11, window=50, max_len=400, generator=g,
                         length_multiple=length_multiple)
    tile, dense = 32, b.mask
    bs, q_len, kv_len = dense.shape
    bm = b.block_mask(tile=tile)
    assert torch.equal(create_mask(bm.mask_mod, bs, None, q_len, kv_len, device="cpu")[:, 0], dense)
    padded = torch.zeros(bs, -(-q_len // tile) * tile, -(-kv_len // tile) * tile, dtype=torch.bool)
    padded[:, :q_len, :kv_len] = dense
    needed = padded.view(bs, padded.shape[1] // tile, tile, padded.shape[2] // tile, tile).any(4).any(2)
    listed = torch.zeros_like(needed)
    for row in range(bs):
        for t in range(needed.shape[1]):
            listed[row, t, bm.kv_indices[row, 0, t, :bm.kv_num_blocks[row, 0, t]].long()] = True
    assert torch.equal(listed, needed) and needed.float().mean() < 0.6


def test_flex_attention_drafts_and_trains_as_the_dense_mask_does(tiny_target_dir):
    """The drafter's forward and its gradients under the block mask equal those under the dense mask
    (fp32 on CPU: gradients through the materialised mask, FlexAttention having no CPU backward), and
    so does a forward through FlexAttention's own reference (no gradients)."""
    from dspine.train.trainer import build_drafter, load_training_target, target_hidden

    cfg = TrainConfig(data="unused", run_dir="unused", target=str(tiny_target_dir), blocks_per_seq=6,
                      drafter=dict(intermediate_size=64, transfer_rank=16, block_size=4, sliding_window=24,
                                   injection_top_k=4, selection_top_k=4, successor_table_size=4))
    target, mask_id = load_training_target(cfg, "cpu")
    g = torch.Generator().manual_seed(3)
    recs = [{"ids": torch.randint(20, 400, (n,), generator=g).tolist(), "answer_start": 5} for n in (70, 45, 90)]
    b = make_block_batch(recs, block_size=4, blocks_per_seq=6, window=24, max_len=128, generator=g)
    outs, grads = [], []
    for mask in (b.mask, b.block_mask(tile=16)):
        torch.manual_seed(0)
        model, _ = build_drafter(cfg, target, mask_id, "cpu")
        hidden = target_hidden(target, b.input_ids, model.config.target_layer_ids)
        bs, length = b.input_ids.shape
        kv = model.context_key_values(model.project_context(hidden), torch.arange(length)[None].expand(bs, -1))
        out = model(b.anchor_ids, b.block_positions, kv, mask).hidden
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-3, atol=1e-6)
    with torch.no_grad():                                                  # FlexAttention's reference
        flex = model(b.anchor_ids, b.block_positions, kv, b.block_mask(tile=16)).hidden
    torch.testing.assert_close(flex, outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_flex_attention_matches_the_dense_mask_gpu():
    """One draft layer at the campaign's shape (64 rows x 128 blocks of 16, L 1,024, window 2,048,
    SmolLM2's 9/3 heads of 64) in bf16: compiled block-sparse FlexAttention against SDPA with the
    dense mask, output and input gradients."""
    from dspine.model.layers import block_sparse_attention

    g = torch.Generator().manual_seed(0)
    recs = [{"ids": torch.randint(5, 49000, (int(n),), generator=g).tolist(), "answer_start": 64}
            for n in torch.randint(400, 1024, (64,), generator=g)]
    b = make_block_batch(recs, block_size=16, blocks_per_seq=128, window=2048, max_len=1024, generator=g).to("cuda")
    bs, q_len, kv_len = b.mask.shape
    q = torch.randn(bs, 9, q_len, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(bs, 3, kv_len, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    flex = block_sparse_attention(q, k, v, b.block_mask())
    grads = torch.autograd.grad(flex.float().square().sum(), (q, k, v))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=b.mask[:, None], enable_gqa=True)
    want = torch.autograd.grad(dense.float().square().sum(), (q, k, v))
    torch.testing.assert_close(flex.float(), dense.float(), rtol=2e-2, atol=2e-2)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got.float(), ref.float(), rtol=5e-2, atol=5e-2)


def test_anchors_are_distinct_and_a_short_answers_repeats_carry_no_labels():
    from dspine.train.blocks import draw_anchors

    g = torch.Generator().manual_seed(1)
    starts = torch.arange(40, 90)
    anchors, repeat = draw_anchors(starts, 16, g)
    assert len(set(anchors.tolist())) == 16 and not repeat.any()                   # without replacement
    assert anchors.tolist() == sorted(anchors.tolist()) and set(anchors.tolist()) <= set(starts.tolist())
    few = torch.tensor([5, 9, 12])
    anchors, repeat = draw_anchors(few, 8, g)
    assert anchors.tolist() == sorted(anchors.tolist()) and int(repeat.sum()) == 5
    assert sorted(anchors[~repeat].tolist()) == [5, 9, 12]                          # each start once, unflagged
    rec = {"ids": list(range(100, 112)), "answer_start": 8}                       # starts 8, 9, 10
    b = make_block_batch([rec], block_size=3, blocks_per_seq=6, window=4, max_len=64, generator=g,
                         length_multiple=4)
    labelled = [a for a, y in zip(b.anchors[0].tolist(), b.labels.tolist()) if y != [-100, -100]]
    assert sorted(labelled) == [8, 9, 10]                                         # three blocks weigh, not six


@pytest.mark.parametrize("which", ["llama", "qwen3"])
def test_target_hidden_runs_only_the_needed_layers_and_equals_output_hidden_states(which):
    from conftest import tiny_llama, tiny_qwen3

    from dspine.train.trainer import target_hidden

    target = tiny_llama() if which == "llama" else tiny_qwen3()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 256, (3, 20), generator=g)
    valid = torch.arange(20)[None] < torch.tensor([20, 13, 7])[:, None]       # right-padded
    ids = ids.masked_fill(~valid, 0)
    with torch.no_grad():
        full = target(input_ids=ids, attention_mask=valid.long(), output_hidden_states=True).hidden_states
    runs = {"deeper": 0, "lm_head": 0}
    target.model.layers[4].register_forward_hook(lambda *_: runs.__setitem__("deeper", runs["deeper"] + 1))
    target.lm_head.register_forward_hook(lambda *_: runs.__setitem__("lm_head", runs["lm_head"] + 1))
    hooks = [len(layer._forward_hooks) for layer in target.model.layers]
    for layer_ids in ([0, 3, 1], [2, 5]):                # the last layer's states are after the final norm
        got = target_hidden(target, ids, layer_ids)
        want = torch.cat([full[i + 1] for i in layer_ids], dim=-1)
        assert got.shape == want.shape
        torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    assert runs == {"deeper": 1, "lm_head": 0}          # layer 4 ran for [2, 5] only; lm_head never
    assert [len(layer._forward_hooks) for layer in target.model.layers] == hooks   # its own hooks are gone


def test_the_target_forward_never_uses_cudnn_attention_while_the_drafter_may():
    """cuDNN's per-call host cost is paid only where its masked kernels help (the drafter): inside a
    run with `cudnn_attention` the target's layers see cuDNN off, the drafter's context sees it on."""
    from conftest import tiny_llama

    from dspine.train.config import TrainConfig
    from dspine.train.trainer import attention_backends, target_hidden

    target = tiny_llama()
    seen = []
    target.model.layers[0].register_forward_pre_hook(
        lambda *_: seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())))
    ids = torch.randint(4, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    for cudnn in (True, False):
        with attention_backends(TrainConfig(data="unused.jsonl", run_dir="unused", cudnn_attention=cudnn)):
            drafter_side = torch.backends.cuda.cudnn_sdp_enabled()
            target_hidden(target, ids, [0, 2])
            assert torch.backends.cuda.cudnn_sdp_enabled() == drafter_side == cudnn   # restored after the target
    assert seen == [(False, True), (False, True)]


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
    so_far = json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())["dspine_training"]
    assert (so_far["step"], so_far["steps"]) == (0, 30)                             # the weights so far, exported
    export = train(cfg, device="cpu", progress=False)                                 # resumes, finishes
    assert json.loads((export / "config.json").read_text())["dspine_training"]["step"] == 30
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log[0]["step"] == 5 and log[-1]["step"] == 30 and "heldout_tau" in log[-1]
    assert log[-1]["final"] < log[0]["final"] - 0.5
    for key in ("transition", "layers", "confidence"):
        assert key in log[-1]
    seen = [e["labels_seen"] for e in log]                      # cumulative, and what the steps labelled
    assert seen == sorted(seen) and seen[0] > 0 and log[-1]["device_seconds"] > log[0]["device_seconds"]
    card = (export / "README.md").read_text()
    assert f"steps 30, label tokens seen {seen[-1]}, device-minutes" in card and "1 x CPU" in card
    assert "Data hash: " in card and "(12 sequences)" in card
    model = load_checkpoint(export)
    assert model.config.block_size == 4 and model.config.injection
    from transformers import AutoConfig

    from dspine.engine.targets import target_identity

    recorded = json.loads((export / "config.json").read_text())["dspine_target"]
    assert recorded["fingerprint"] == target_identity(AutoConfig.from_pretrained(tiny_target_dir))["fingerprint"]


def test_a_time_limited_stop_ends_the_log_with_a_heldout_point(tmp_path, tiny_target_dir, monkeypatch):
    """A leg stopped by its time limit between log steps still logs its last steps and the held-out tau
    there: each campaign leg adds a point to the learning curve."""
    import types

    from dspine.train import trainer

    clock = [0.0]                            # one second per optimizer step, nothing else takes time
    step_once = trainer.train_step

    def timed_step(*args, **kwargs):
        clock[0] += 1.0
        return step_once(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", timed_step)
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    cfg = _config(tmp_path, tiny_target_dir, steps=30)
    assert train(cfg, device="cpu", time_limit_s=7.5, progress=False) is None
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert [e["step"] for e in log] == [5, 8]                     # the log step, then the stop's own entry
    assert "heldout_tau" not in log[0] and log[1]["heldout_tau"] >= 1.0
    assert log[1]["labels_seen"] > log[0]["labels_seen"] and log[1]["step_seconds"] == 1.0


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


def test_train_config_types_defaults_and_overrides(tmp_path):
    import yaml

    from dspine.train.config import TrainConfig, TrainConfigError, config_path, packaged_configs

    assert set(packaged_configs()) >= {"smollm2-dspine", "smollm2-ablation", "qwen3-8b-dspine"}
    for name in packaged_configs():  # the defaults are what ships: every shipped value equals its default
        shipped = yaml.safe_load(config_path(name).read_text())
        defaults = TrainConfig(data="d", run_dir="r")
        differing = {k: v for k, v in shipped.items() if k not in ("data", "run_dir", "target", "drafter")
                     and getattr(defaults, k) != v}
        assert differing == {}, (name, differing)
    path = tmp_path / "c.yaml"
    path.write_text("data: d.jsonl\nrun_dir: r\nlr: 6e-4\ndrafter:\n  injection_top_k: 8\n")
    cfg = TrainConfig.from_yaml(path, ["drafter.selection=argmax", "steps=7"], target="t")
    assert cfg.lr == 6e-4 and isinstance(cfg.lr, float)  # YAML reads 6e-4 as a string
    assert cfg.drafter == {"injection_top_k": 8, "selection": "argmax"} and cfg.steps == 7 and cfg.target == "t"
    assert TrainConfig.from_yaml("smollm2-dspine").drafter["injection_candidates"] == "first_layer"
    for text, message in (("lr: fast", "lr = 'fast': expected float"),
                          ("steps: 1.5", "steps = 1.5: expected int"),
                          ("lrr: 1", r"unknown key\(s\) \['lrr'\]; valid keys: data, run_dir"),
                          ("drafter: {injection: 1}", "drafter.injection = 1: expected bool"),
                          ("drafter: {block: 4}", r"drafter: unknown key\(s\) \['block'\]"),
                          ("grad_accum_steps: 0", "grad_accum_steps = 0: must be >= 1")):
        path.write_text("data: d\nrun_dir: r\n" + text + "\n")
        with pytest.raises(TrainConfigError, match=message):
            TrainConfig.from_yaml(path)
    with pytest.raises(TrainConfigError, match="only section is `drafter`"):
        TrainConfig.from_yaml("smollm2-dspine", ["optim.lr=1"])
    with pytest.raises(TrainConfigError, match="neither a file nor a packaged config.*smollm2-dspine"):
        TrainConfig.from_yaml("no-such-config")


def test_train_checks_data_and_target_before_loading_it(tmp_path, tiny_target_dir, monkeypatch):
    from transformers import AutoConfig

    import dspine.train.trainer as trainer
    from dspine.engine.targets import target_identity
    from dspine.train.config import TrainConfigError

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded before the checks")

    monkeypatch.setattr(trainer, "build_training", no_load)
    cfg = _config(tmp_path, tiny_target_dir, steps=3)
    cfg.data = str(tmp_path / "missing.jsonl")
    with pytest.raises(TrainConfigError, match="missing.jsonl does not exist.*dspine gen-data"):
        train(cfg, device="cpu", progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2, 3], "answer_start": 1}\nnot json\n')
    cfg.data = str(bad)
    with pytest.raises(TrainConfigError, match="bad.jsonl:2: not a `dspine gen-data` record"):
        train(cfg, device="cpu", progress=False)
    other = target_identity(AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=2), "other-target")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"ids": [1, 2, 3, 4], "answer_start": 1,
                                 "target": {"name": "other-target", "fingerprint": other["fingerprint"]}}) + "\n")
    cfg.data = str(wrong)
    with pytest.raises(TrainConfigError, match=f"'other-target' \\(fingerprint {other['fingerprint']}\\).*"
                                               f"{str(tiny_target_dir)!r}.*dspine gen-data --target"):
        train(cfg, device="cpu", progress=False)
    assert not (tmp_path / "run" / "train_config.json").exists()


def test_throughput_benchmark_writes_its_figures(tmp_path):
    """The benchmark's main on CPU with a tiny random target: a table and JSON with the command,
    device, date, torch version and per-variant figures; baseline and new agree on the first loss."""
    from transformers import LlamaConfig

    from dspine.bench.train_throughput import main

    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    argv = ["--variants", "smollm2:baseline:b32x16", "smollm2:new:b32x16", "--target",
            f"smollm2=random:{tmp_path / 'tiny'}", "--max-len", "32", "--batch-size", "2", "--warmup", "1",
            "--steps", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python -m dspine.bench.train_throughput --variants")
    assert report["device"] == "cpu" and report["torch"] == torch.__version__ and report["date"][:2] == "20"
    assert set(report["variants"]) == {"smollm2:baseline:b2x16", "smollm2:new:b2x16"}
    for name, figures in report["variants"].items():
        assert figures["label_tokens_per_s"] > 0 and figures["step_seconds"] > 0, name
        assert figures["mfu"] is None and figures["peak_memory_gib"] is None and figures["batch_size"] == 2
    base, new = (report["variants"][n]["first_step_terms"] for n in ("smollm2:baseline:b2x16", "smollm2:new:b2x16"))
    assert base.keys() == new.keys() and all(abs(base[k] - new[k]) < 1e-3 for k in base)


def test_throughput_benchmark_trace_splits_a_step_into_the_trainers_phases(tmp_path):
    """--trace on CPU: every phase of a training step (target forward, drafter forward, vocabulary
    losses, backward, optimizer) has host time, the phases fit inside the step, and the operator
    table is written."""
    from transformers import LlamaConfig

    from dspine.bench.train_throughput import main

    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "bench.json"
    assert main(["--variants", "smollm2:new:b32x16", "--target", f"smollm2=random:{tmp_path / 'tiny'}",
                 "--max-len", "32", "--batch-size", "2", "--warmup", "1", "--steps", "2", "--out", str(out),
                 "--trace", str(tmp_path / "trace")]) == 0
    figures = json.loads(out.read_text())["variants"]["smollm2:new:b2x16"]
    phases = figures["phases_ms_per_step"]
    assert set(phases) == {f"{p}_host" for p in ("target", "drafter", "vocab_losses", "backward", "optimizer")}
    assert all(ms > 0 for ms in phases.values())
    assert sum(phases.values()) <= figures["step_seconds"] * 1e3
    table = (tmp_path / "trace" / "smollm2_new_b2x16.txt").read_text()
    assert "Self CPU" in table and "Input Shapes" in table


def test_training_through_the_fused_loss_kernel_follows_the_pytorch_chunks(tmp_path, tiny_target_dir, monkeypatch):
    """Two steps with the vocabulary losses' chunks in the Triton kernel (interpreter; the trainer's
    chunk_fn with the kernel chosen, as on CUDA) log the same losses as with the PyTorch chunks, and
    the kernel really ran."""
    pytest.importorskip("triton")
    import dspine.kernels.cross_entropy as kernel_module
    import dspine.train.losses as losses
    import dspine.train.trainer as trainer
    from dspine.kernels import dispatch

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors need the Triton interpreter")
    launches = []
    real = kernel_module.cross_entropy_grads
    monkeypatch.setattr(losses, "cross_entropy_grads", lambda *a: launches.append(1) or real(*a))

    def kernel_chosen(reference):
        chunk_fn = losses.fused_chunk_gradients(reference)

        def run(*args):
            with dispatch.forced("triton"):
                return chunk_fn(*args)
        return run

    logs = []
    for name in ("torch", "fused"):
        (tmp_path / name).mkdir()
        if name == "fused":
            monkeypatch.setattr(trainer, "fused_chunk_gradients", kernel_chosen)
        train(_config(tmp_path / name, tiny_target_dir, steps=2), device="cpu", progress=False)
        logs.append(json.loads((tmp_path / name / "run" / "log.json").read_text()))
    assert launches                                                            # the fused run used it
    for a, b in zip(*logs):
        for key in ("final", "transition", "layers", "total"):
            assert b[key] == pytest.approx(a[key], rel=1e-3), (a["step"], key)


def test_throughput_benchmark_times_a_data_files_sequences_with_length_grouping(tmp_path):
    """--data: the figures come from a gen-data file's sequences (the report says which); the
    campaign's variant (cuDNN allowed, a quarter of the layer-wise rows, length groups) runs."""
    from transformers import LlamaConfig

    from dspine.bench.train_throughput import main

    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(tmp_path / "tiny")
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{k}", "ids": torch.randint(4, 300, (int(n),), generator=g).tolist(),
                                        "answer_start": 4}) + "\n" for k, n in enumerate(range(12, 60, 3))))
    out = tmp_path / "bench.json"
    assert main(["--variants", "smollm2:new:b32x128+cudnn+layers0.25+group16", "--target",
                 f"smollm2=random:{tmp_path / 'tiny'}", "--max-len", "48", "--batch-size", "2", "--warmup", "1",
                 "--steps", "2", "--data", str(data), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["data"] == str(data)
    figures = report["variants"]["smollm2:new:b2x128+cudnn+layers0.25+group16"]
    assert figures["length_groups"] == 16 and figures["layer_fraction"] == 0.25 and figures["cudnn"] is True
    assert figures["label_tokens_per_s"] > 0


@pytest.mark.parametrize("which,norms", [("llama", 13), ("qwen3", 25)])   # 2 a layer + final; qwen3 adds q/k norms
def test_fused_target_norms_switch_every_rms_norm_and_keep_the_hidden_states(which, norms):
    """fp32: the same hidden states; bf16: at least as close to the fp32 forward as transformers'
    own bf16 chain (one rounding instead of one per elementwise kernel)."""
    from conftest import tiny_llama, tiny_qwen3

    from dspine.train.trainer import fuse_rms_norms, target_hidden

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 256, (2, 24), generator=g)
    targets = {}
    for dtype in (torch.float32, torch.bfloat16):
        targets[dtype] = tiny_llama() if which == "llama" else tiny_qwen3()
        weights = torch.Generator().manual_seed(1)
        for name, module in targets[dtype].named_modules():
            if name.endswith("norm"):
                module.weight.copy_(torch.rand(module.weight.shape, generator=weights) + 0.5)   # a weight that matters
        targets[dtype].to(dtype)
    exact = target_hidden(targets[torch.float32], ids, [1, 3, 5])
    chain = target_hidden(targets[torch.bfloat16], ids, [1, 3, 5]).float()
    for dtype, target in targets.items():
        assert fuse_rms_norms(target) == norms
        assert sum("forward" in m.__dict__ for m in target.modules()) == norms
    torch.testing.assert_close(target_hidden(targets[torch.float32], ids, [1, 3, 5]), exact, rtol=1e-5, atol=1e-5)
    fused = target_hidden(targets[torch.bfloat16], ids, [1, 3, 5]).float()
    error = lambda h: float((h - exact).norm() / exact.norm())    # noqa: E731
    assert error(fused) <= error(chain) < 0.05


def test_fused_target_norms_leave_other_norm_formulas_alone():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from dspine.train.trainer import fuse_rms_norms

    norm = GemmaRMSNorm(32)                  # x / rms(x) * (1 + weight): not F.rms_norm's formula
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    x = torch.randn(4, 32)
    want = norm(x)
    assert fuse_rms_norms(torch.nn.Sequential(norm)) == 0
    torch.testing.assert_close(norm(x), want)


def test_compiled_target_layers_give_the_eager_hidden_states_at_every_length():
    """`compile_target`'s compiled decoder layers (dynamic shapes): the same hidden states as the
    eager target at several padded lengths, the stopping hook still stopping after layer 3."""
    from conftest import tiny_llama

    from dspine.train.trainer import compile_target_layers, target_hidden

    target = tiny_llama()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(4, 256, (2, length), generator=g) for length in (64, 128, 192, 64)]
    want = [target_hidden(target, ids, [1, 3]) for ids in batches]
    compile_target_layers(target, backend="aot_eager")
    ran = []
    target.model.layers[4].register_forward_hook(lambda *_: ran.append(4))
    for ids, expected in zip(batches, want):
        torch.testing.assert_close(target_hidden(target, ids, [1, 3]), expected, rtol=1e-5, atol=1e-5)
    assert ran == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_target_layers_match_eager_on_cuda_gpu():
    """Inductor's compiled layers in bf16 on the GPU: the eager hidden states within bf16 rounding."""
    from conftest import tiny_llama

    from dspine.train.trainer import compile_target_layers, fuse_rms_norms, target_hidden

    target = tiny_llama(hidden=128).to("cuda", torch.bfloat16)
    fuse_rms_norms(target)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(4, 256, (4, length), generator=g).cuda() for length in (128, 192, 128)]
    want = [target_hidden(target, ids, [1, 3, 5]).float() for ids in batches]
    compile_target_layers(target)
    for ids, expected in zip(batches, want):
        got = target_hidden(target, ids, [1, 3, 5]).float()
        assert float((got - expected).norm() / expected.norm()) < 2e-2
