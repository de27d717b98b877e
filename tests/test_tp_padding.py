"""dspine/bench/tp_padded_pair.py: the head-padded target and drafter compute what the originals do.

Tiny grouped-query models with 6 query / 3 KV heads (head_dim 16, the SmolLM2 shape scaled down:
3 KV heads cannot be split 2 ways) are padded for tp 2 to 8 / 4 heads. Checked: target logits
(Llama untied, Llama tied and sharded, Qwen2 with q/k/v biases, Qwen3 with q/k norms in bf16),
drafter hidden states, proposals and whole speculative generations against the originals; a
negative control (live weights in an added head change the logits, so the comparisons can fail);
and the refusals (existing OUT_DIR, heads not grouped, head_dim not derivable) with nothing left
half-written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import drafter_for, fixed_prompts
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspine import generate
from dspine.model.checkpoint import load_checkpoint, read_config, save_checkpoint
from dspine.engine.proposer import DSpineProposer
from dspine.bench import tp_padded_pair as pad

HEADS, KV_HEADS, HEAD_DIM = 6, 3, 16
TP = 2
HEADS_PAD, KV_PAD = 8, 4  # kv 3 -> 4 (next multiple of 2), q = 4 kv x 2 per group
VOCAB = 128
ATOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Tiny GQA targets and a drafter, saved as a real pair of folders
# ---------------------------------------------------------------------------------------------

def gqa_target(arch: str = "llama", tie: bool = False, seed: int = 0):
    """A random 3-layer target with 6 q / 3 kv heads of size 16 (hidden 96), fp32, eval."""
    import transformers

    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                     max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=tie,
                     bos_token_id=1, eos_token_id=2)
    model = model_cls(cfg).eval().requires_grad_(False)
    if arch == "qwen2":  # q/k/v biases are zero-initialised: make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model


def save_target(model, path: Path, dtype=torch.float32, shard: str | None = None) -> Path:
    """save_pretrained (safetensors) plus the non-weight files a real folder carries."""
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(dtype).save_pretrained(path, **kwargs)
    model.to(torch.float32)
    (path / "chat_template.jinja").write_text("{{ messages }}\n")
    (path / "tokenizer.json").write_text('{"model": {"vocab": {}}}\n')
    return path


def live_drafter(target, seed: int = 0):
    """A random drafter whose weights are large enough that every attention head matters."""
    model = drafter_for(target, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
        model.mask_embedding.copy_(torch.randn(model.mask_embedding.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(original target, original drafter dir, target dir, padded OUT dir), written once."""
    root = tmp_path_factory.mktemp("pair")
    target = gqa_target("llama")
    target_dir = save_target(target, root / "target")
    drafter_dir = save_checkpoint(live_drafter(target), root / "drafter", dtype=torch.float32,
                                  extra_config={"dspine_training": {"steps": 1}})
    (drafter_dir / "README.md").write_text("tiny drafter\n")
    out = root / "padded"
    pad.make_pair(target_dir, drafter_dir, out, tp=TP)
    return target, drafter_dir, target_dir, out


def load_target(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval().requires_grad_(False)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def random_ids(n: int = 2, length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------

def test_layout_keeps_grouping():
    smollm2 = pad.head_layout(9, 3, 64, 576, 2, "smollm2")
    assert (smollm2.q_padded, smollm2.kv_padded, smollm2.groups) == (12, 4, 3) and smollm2.needs_padding
    # Real query heads 0..8 keep kv heads 0..2; added heads 9..11 read the added kv head 3.
    assert [j // smollm2.groups for j in range(12)] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    # Each tp rank gets whole groups: rank r holds q heads 6r..6r+5 and kv heads 2r, 2r+1.
    per_rank_q, per_rank_kv = smollm2.q_padded // 2, smollm2.kv_padded // 2
    for r in range(2):
        assert {j // 3 for j in range(r * per_rank_q, (r + 1) * per_rank_q)} == {2 * r, 2 * r + 1}
        assert per_rank_kv == 2
    assert not pad.head_layout(8, 2, None, 512, 2, "x").needs_padding
    assert pad.head_layout(9, 3, None, 576, 2, "x").head_dim == 64
    mha = pad.head_layout(5, None, 16, 80, 2, "x")
    assert (mha.q_padded, mha.kv_padded) == (6, 6)


def test_pad_attention_weights_shapes_and_zeros():
    layout = pad.head_layout(HEADS, KV_HEADS, HEAD_DIM, 96, TP, "x")
    d, h = HEAD_DIM, 96
    state = {"model.layers.0.self_attn.q_proj.weight": torch.randn(HEADS * d, h),
             "model.layers.0.self_attn.q_proj.bias": torch.randn(HEADS * d),
             "model.layers.0.self_attn.k_proj.weight": torch.randn(KV_HEADS * d, h),
             "model.layers.0.self_attn.v_proj.weight": torch.randn(KV_HEADS * d, h),
             "model.layers.0.self_attn.o_proj.weight": torch.randn(h, HEADS * d),
             "model.layers.0.self_attn.o_proj.bias": torch.randn(h),
             "model.layers.0.self_attn.q_norm.weight": torch.randn(d),
             "model.layers.0.mlp.up_proj.weight": torch.randn(32, h)}
    out = pad.pad_attention_weights(state, layout)
    q, o = out["model.layers.0.self_attn.q_proj.weight"], out["model.layers.0.self_attn.o_proj.weight"]
    assert q.shape == (HEADS_PAD * d, h) and torch.equal(q[: HEADS * d], state[
        "model.layers.0.self_attn.q_proj.weight"]) and not q[HEADS * d:].any()
    assert out["model.layers.0.self_attn.q_proj.bias"].shape == (HEADS_PAD * d,)
    assert out["model.layers.0.self_attn.k_proj.weight"].shape == (KV_PAD * d, h)
    assert o.shape == (h, HEADS_PAD * d) and not o[:, HEADS * d:].any()
    for name in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.self_attn.q_norm.weight",
                 "model.layers.0.mlp.up_proj.weight"):
        assert out[name] is state[name]
    with pytest.raises(pad.PadError, match="q_proj.weight has shape"):  # e.g. a gated q_proj (Qwen3-Next)
        pad.pad_attention_weights({"layers.0.self_attn.q_proj.weight": torch.randn(2 * HEADS * d, h)}, layout)


# ---------------------------------------------------------------------------------------------
# Target
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,tie,dtype,shard", [("llama", False, torch.float32, None),
                                                  ("llama", True, torch.float32, "40KB"),
                                                  ("qwen2", False, torch.float32, None),
                                                  ("qwen3", True, torch.bfloat16, None)],
                         ids=["llama", "llama-tied-sharded", "qwen2-bias", "qwen3-qknorm-bf16"])
def test_padded_target_gives_identical_logits(tmp_path, arch, tie, dtype, shard):
    src = save_target(gqa_target(arch, tie), tmp_path / "src", dtype=dtype, shard=shard)
    summary = pad.pad_target_dir(src, tmp_path / "out", tp=TP)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS_PAD, KV_PAD, HEAD_DIM)
    assert cfg["num_attention_heads"] % TP == 0 and cfg["num_key_value_heads"] % TP == 0
    assert cfg["dspine_tp_padding"]["num_key_value_heads"] == KV_HEADS
    assert summary["padded_tensors"] == 3 * (4 + (3 if arch == "qwen2" else 0))
    for name in ("chat_template.jinja", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes(), name
    # Same files, same index, same dtype; every non-attention tensor byte-identical.
    src_files = sorted(p.name for p in src.glob("*.safetensors"))
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == src_files
    assert (len(src_files) > 1) == bool(shard) == (tmp_path / "out" / pad.INDEX_FILE).is_file()
    for name in src_files:
        before, after = load_file(str(src / name)), load_file(str(tmp_path / "out" / name))
        assert before.keys() == after.keys()
        for key, t in before.items():
            assert after[key].dtype == t.dtype == dtype
            if pad.ATTENTION_TENSOR.search(key) is None or key.endswith("o_proj.bias"):
                assert torch.equal(after[key], t), key
    if shard:
        index = json.loads((tmp_path / "out" / pad.INDEX_FILE).read_text())
        assert index["weight_map"] == json.loads((src / pad.INDEX_FILE).read_text())["weight_map"]
    original, padded = load_target(src), load_target(tmp_path / "out")
    assert padded.config.num_key_value_heads == KV_PAD
    ids = random_ids()
    diff = (logits_of(original, ids) - logits_of(padded, ids)).abs().max()
    assert diff <= ATOL, f"padded target logits differ by {diff:.2e}"


def test_negative_control_live_added_head_changes_logits(pair):
    """An added head with nonzero values and o_proj input columns contributes: the logit comparison
    catches it. (Zero v rows alone already silence an added head — its output is the mean of zero
    values — so the control fills both; the script zeroes both, and q, as a double guard.)"""
    _, _, target_dir, out = pair
    tampered = out.parent / "tampered"
    shutil.copytree(out / "target", tampered)
    weights = load_file(str(tampered / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    for name, rows_or_cols in (("model.layers.1.self_attn.v_proj.weight", KV_HEADS * HEAD_DIM),
                               ("model.layers.1.self_attn.o_proj.weight", HEADS * HEAD_DIM)):
        w = weights[name]
        if name.endswith("o_proj.weight"):
            w[:, rows_or_cols:] = torch.randn(w[:, rows_or_cols:].shape, generator=g) * 0.2
        else:
            w[rows_or_cols:] = torch.randn(w[rows_or_cols:].shape, generator=g) * 0.2
    save_file(weights, str(tampered / "model.safetensors"), metadata={"format": "pt"})
    ids = random_ids()
    original, padded, bad = load_target(target_dir), load_target(out / "target"), load_target(tampered)
    assert (logits_of(original, ids) - logits_of(padded, ids)).abs().max() <= ATOL
    assert (logits_of(original, ids) - logits_of(bad, ids)).abs().max() > 1e-2


def test_negative_control_broken_grouping_changes_outputs(pair, tmp_path, monkeypatch):
    """Padding that moves the added query heads in front of the real ones (k/v still appended) puts
    real query heads on the wrong KV heads: both the target and the drafter comparisons catch it."""
    target, drafter_dir, target_dir, _ = pair
    correct = pad.pad_attention_weights

    def misgrouped(state, layout, where="checkpoint"):
        out = correct(state, layout, where)
        extra = (layout.q_padded - layout.num_heads) * layout.head_dim
        for name, t in out.items():
            if name.endswith("q_proj.weight"):
                out[name] = torch.cat([t[-extra:], t[:-extra]], 0)
            elif name.endswith("o_proj.weight"):
                out[name] = torch.cat([t[:, -extra:], t[:, :-extra]], 1)
        return out

    monkeypatch.setattr(pad, "pad_attention_weights", misgrouped)
    pad.make_pair(target_dir, drafter_dir, tmp_path / "bad")
    ids = random_ids()
    assert (logits_of(target, ids) - logits_of(load_target(tmp_path / "bad" / "target"), ids)).abs().max() > 1e-2
    original = load_checkpoint(drafter_dir, target=target, dtype=torch.float32)
    bad = load_checkpoint(tmp_path / "bad" / "drafter", target=target, dtype=torch.float32)
    hidden = torch.randn(2, 12, original.config.num_context_features * original.config.hidden_size,
                         generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([5, 9])
    assert (draft_hidden(original, hidden, anchors) - draft_hidden(bad, hidden, anchors)).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------
# Drafter
# ---------------------------------------------------------------------------------------------

def draft_hidden(model, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """One block per row after a full context: [bs, L, K*H] target hidden -> [bs, B, H]."""
    bs, length = hidden.shape[:2]
    blk = model.config.block_size
    ctx_pos = torch.arange(length)[None].expand(bs, -1)
    kv = model.context_key_values(model.project_context(hidden), ctx_pos)
    positions = length + torch.arange(blk)[None].expand(bs, -1)
    mask = torch.ones(bs, blk, length + blk, dtype=torch.bool)
    with torch.no_grad():
        return model(anchors[:, None], positions, kv, mask).hidden


def test_padded_drafter_config_and_weights(pair):
    _, drafter_dir, _, out = pair
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    src = json.loads((drafter_dir / "config.json").read_text())
    for block in (cfg, cfg["dspine_config"]):  # the HF-style mirror and the source of truth
        assert (block["num_attention_heads"], block["num_key_value_heads"], block["head_dim"]) == \
            (HEADS_PAD, KV_PAD, HEAD_DIM)
    assert cfg["dflash_config"] == src["dflash_config"] and cfg["torch_dtype"] == src["torch_dtype"]
    assert cfg["dspine_training"] == {"steps": 1} and cfg["dspine_tp_padding"]["tp"] == TP
    assert (out / "drafter" / "README.md").read_text() == "tiny drafter\n"
    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as a, \
            safe_open(str(out / "drafter" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        changed = {k for k in set(a.keys()) if a.get_slice(k).get_shape() != b.get_slice(k).get_shape()}
        assert changed == {f"layers.{i}.self_attn.{p}_proj.weight" for i in range(5) for p in "qkvo"}
        for k in set(a.keys()) - changed:
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_padded_drafter_drafts_identically(pair):
    target, drafter_dir, _, out = pair
    original = load_checkpoint(drafter_dir, target=target, dtype=torch.float32)
    padded = load_checkpoint(out / "drafter", target=target, dtype=torch.float32)
    assert padded.layers[0].self_attn.num_kv_heads == KV_PAD
    g = torch.Generator().manual_seed(3)
    k_h = original.config.num_context_features * original.config.hidden_size
    hidden = torch.randn(3, 20, k_h, generator=g)
    anchors = torch.randint(0, VOCAB, (3,), generator=g)
    h0, h1 = draft_hidden(original, hidden, anchors), draft_hidden(padded, hidden, anchors)
    assert h0.abs().max() > 0.1
    assert (h0 - h1).abs().max() <= ATOL
    assert (original.logits(h0) - padded.logits(h1)).abs().max() <= ATOL
    proposals = []
    for model in (original, padded):
        proposer = DSpineProposer(model)
        proposer.start(torch.zeros(3, 20, dtype=torch.long), hidden, torch.tensor([20, 17, 9]))
        proposals.append(proposer.propose(anchors, torch.zeros(3), None))
    assert torch.equal(proposals[0].tokens, proposals[1].tokens)
    assert (proposals[0].confidence - proposals[1].confidence).abs().max() <= ATOL


def test_bf16_sharded_drafter_keeps_dtype_and_shards(pair, tmp_path):
    target = pair[0]
    src = save_checkpoint(live_drafter(target, seed=7), tmp_path / "src", dtype=torch.bfloat16,
                          max_shard_bytes=100_000)
    pad.pad_drafter_dir(src, tmp_path / "out", tp=TP)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["num_key_value_heads"] == KV_PAD
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    original = load_checkpoint(src, target=target, dtype=torch.float32)
    padded = load_checkpoint(tmp_path / "out", target=target, dtype=torch.float32)
    hidden = torch.randn(2, 12, original.config.num_context_features * original.config.hidden_size,
                         generator=torch.Generator().manual_seed(6))
    anchors = torch.tensor([7, 30])
    assert (draft_hidden(original, hidden, anchors) - draft_hidden(padded, hidden, anchors)).abs().max() <= ATOL


def test_padded_pair_generates_identically(pair):
    """The deployed combination (padded target + padded drafter) against the original pair: the
    same tokens and the same acceptance, round by round."""
    target, drafter_dir, _, out = pair
    padded_target = load_target(out / "target")
    original = load_checkpoint(drafter_dir, target=target, dtype=torch.float32)
    padded = load_checkpoint(out / "drafter", target=padded_target, dtype=torch.float32)
    prompts = fixed_prompts(6, VOCAB, seed=11)
    common = {"max_new_tokens": 24, "stop_token_ids": [], "batch_size": 3}
    a = generate(target, original, prompts, **common)
    b = generate(padded_target, padded, prompts, **common)
    plain = generate(target, None, prompts, **common)
    assert a.tokens == b.tokens == plain.tokens
    for field in ("rounds", "row_rounds", "emitted", "accepted_per_position", "verified_per_position"):
        assert getattr(a.stats, field) == getattr(b.stats, field), field


# ---------------------------------------------------------------------------------------------
# CLI, refusals, atomicity
# ---------------------------------------------------------------------------------------------

def test_cli_prints_heads_and_refuses_existing_out(pair, tmp_path, capsys):
    _, drafter_dir, target_dir, _ = pair
    out = tmp_path / "cli"
    assert pad.main([str(target_dir), str(drafter_dir), str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"{HEADS} q / {KV_HEADS} kv heads (head_dim {HEAD_DIM}) -> {HEADS_PAD} q / {KV_PAD} kv heads" in printed
    assert printed.count("-> ") == 2  # target and drafter
    (out / "marker").write_text("old")
    assert pad.main([str(target_dir), str(drafter_dir), str(out)]) == 2
    assert "exists: pass --force" in capsys.readouterr().err and (out / "marker").is_file()
    assert pad.main([str(target_dir), str(drafter_dir), str(out), "--force"]) == 0
    assert not (out / "marker").exists() and (out / "target" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]  # no temp or .old dirs left
    with pytest.raises(SystemExit) as exc:
        pad.parse_args(["--help"])
    assert exc.value.code == 0 and "--tp-size 2" in capsys.readouterr().out


def test_already_divisible_is_copied_unchanged(pair, tmp_path, capsys):
    _, drafter_dir, target_dir, _ = pair
    out = tmp_path / "tp3"
    assert pad.main([str(target_dir), str(drafter_dir), str(out), "--tp", "3"]) == 0
    assert capsys.readouterr().out.count("already divisible by tp 3, copied unchanged") == 2
    for src, dst in ((target_dir, out / "target"), (drafter_dir, out / "drafter")):
        for p in src.iterdir():
            assert (dst / p.name).read_bytes() == p.read_bytes(), p


def test_the_padded_drafter_has_copy_candidates_off(pair, tmp_path):
    """Copy candidates run at tensor parallel size 1 (the worker drops them at --tp-size > 1): a
    drafter shipped with them on is written for TP with them off, padded or copied."""
    _, drafter_dir, target_dir, _ = pair
    src = tmp_path / "drafter-copy"
    shutil.copytree(drafter_dir, src)
    raw = json.loads((src / "config.json").read_text())
    raw["dspine_config"]["copy_candidates"] = True
    (src / "config.json").write_text(json.dumps(raw))
    for tp in (TP, 3):                                   # padded (9/3 heads at tp 2), copied (tp 3)
        out = tmp_path / f"tp{tp}"
        pad.make_pair(target_dir, src, out, tp=tp)
        written = json.loads((out / "drafter" / "config.json").read_text())["dspine_config"]
        assert written["copy_candidates"] is False, tp
        assert read_config(out / "drafter").copy_candidates is False


def _config_only_dir(path: Path, **cfg) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **cfg}))
    return path


def test_refuses_heads_not_grouped_and_underivable_head_dim(tmp_path):
    bad = _config_only_dir(tmp_path / "bad", hidden_size=96, num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(pad.PadError, match="not a multiple of num_key_value_heads"):
        pad.pad_target_dir(bad, tmp_path / "o1")
    odd = _config_only_dir(tmp_path / "odd", hidden_size=100, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(pad.PadError, match="head_dim"):
        pad.pad_target_dir(odd, tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_failure_leaves_nothing_half_written(pair, tmp_path):
    _, drafter_dir, target_dir, _ = pair
    broken = tmp_path / "inputs" / "drafter"
    broken.parent.mkdir()
    shutil.copytree(drafter_dir, broken)
    (broken / "model.safetensors").unlink()  # config fine, weights gone: fails after the target was written
    outs = tmp_path / "outs"
    outs.mkdir()
    (outs / "pair").mkdir()
    (outs / "pair" / "keep").write_text("old")
    assert pad.main([str(target_dir), str(broken), str(outs / "pair"), "--force"]) == 2
    assert sorted(p.name for p in outs.iterdir()) == ["pair"]
    assert (outs / "pair" / "keep").read_text() == "old"
    with pytest.raises(pad.PadError, match="is or contains the input"):
        pad.make_pair(target_dir, drafter_dir, target_dir.parent, force=True)
