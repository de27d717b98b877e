"""The SGLang draft model under a real TP=2 group: two CPU processes (gloo), each building
`DSpineDraftModel` as a TP worker would and loading the same full checkpoint. Row- and
column-parallel layers must take their rank's slice, replicated modules the whole tensor, and the
two ranks together must hold the checkpoint exactly; attached to a vocab-sharded target head, each
rank must build the whole transfer table and find the global top-k (SGLang 0.5.17 and 0.5.22)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang")

from sglang_cpu import free_port  # noqa: E402
from test_sglang_draft_model import TARGET, dspine_cfg, read_tensors, write_checkpoint  # noqa: E402

HERE = Path(__file__).parent
WORLD = 2

# One TP rank: publish --tp-size 2 server args, join the gloo world, build and load the draft model,
# save its parameters. argv: rank port target_dir checkpoint_dir out_dir tests_dir
RANK_MAIN = r"""
import sys
rank, port, target, ckpt, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sys.path.insert(0, sys.argv[6])
import torch
import sglang.srt.layers.rotary_embedding.base as rotary_base
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils.hf_transformers_utils import get_config
from sglang_cpu import init_tp_groups, publish_args
import dspine.sglang.draft_model as draft_module
import dspine.sglang.draft_weights as weights_module

load_plugins()
args = prepare_server_args(["--model-path", target, "--speculative-algorithm", "dspine",
                            "--speculative-draft-model-path", ckpt, "--device", "cpu", "--skip-tokenizer-init",
                            "--tp-size", "2"])
if hasattr(args, "resolve_once"):
    args.resolve_once()
publish_args(args, world_rank=rank)
init_tp_groups(rank, 2, port)
rotary_base._is_cpu = True
cls, _ = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
model = cls(config=get_config(ckpt, trust_remote_code=False), quant_config=None).eval()
assert weights_module._loading_tp_size() == 2
model.load_weights(iter(__import__("test_sglang_draft_model").read_tensors(ckpt).items()))
params = {n: p.detach().clone() for n, p in model.named_parameters()}

# The target's vocab-parallel head (each rank half the rows): the transfer table and the global top-k
from dspine.sglang import compat
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from test_tp_sharded_loading import head_and_hidden
V, H, K = (getattr(__import__("test_sglang_draft_model"), n) for n in ("V", "H", "K"))
full_head, hidden = head_and_hidden()
head = ParallelLMHead(V, H, params_dtype=torch.float32)
head.weight_loader(head.weight, full_head)
group = compat.tp_group()
model.attach_target_head(head, tp_group=group)
shard = head.shard_indices
ids, vals = draft_module.global_topk(hidden, head.weight, K, num_org=int(shard.num_org_elements),
                                    org_start=int(shard.org_vocab_start_index), tp_size=2, all_gather=group.all_gather)
torch.save({"params": params, "head_rows": head.weight.shape[0], "table": model.transfer_table().clone(),
            "topk_ids": ids, "topk_vals": vals}, f"{out}/rank{rank}.pt")
"""


def head_and_hidden() -> tuple[torch.Tensor, torch.Tensor]:
    """The target head's full weight [V, H] and draft hidden rows [12, H] every rank builds alike."""
    from test_sglang_draft_model import H, V

    g = torch.Generator().manual_seed(21)
    return 0.5 * torch.randn(V, H, generator=g), torch.randn(12, H, generator=g)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """{rank: {parameter name: tensor}} after each TP rank loaded the checkpoint, and the checkpoint."""
    root = tmp_path_factory.mktemp("tp2")
    ckpt = write_checkpoint(root / "draft", dspine_cfg())
    target = root / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(TARGET))
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_MAIN, str(r), str(port), str(target), ckpt, str(root),
                               str(HERE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return {r: torch.load(root / f"rank{r}.pt") for r in range(WORLD)}, read_tensors(ckpt)


def test_each_rank_holds_half_the_head_yet_the_full_transfer_table_and_global_top_k(shards):
    """Vocab-sharded target head: U = E_out P^T gathered whole on every rank, and the candidates
    are the top-k over the whole vocabulary (global ids), as with one GPU."""
    from test_sglang_draft_model import K, V

    ranks, ckpt = shards
    full_head, hidden = head_and_hidden()
    want_table = full_head @ ckpt["transfer.proj.weight"].T
    want_vals, want_ids = (hidden @ full_head.T).topk(K, dim=-1)
    for r in range(WORLD):
        assert ranks[r]["head_rows"] * WORLD >= V > ranks[r]["head_rows"]
        torch.testing.assert_close(ranks[r]["table"], want_table, rtol=1e-5, atol=1e-5)
        assert torch.equal(ranks[r]["topk_ids"].long(), want_ids)
        torch.testing.assert_close(ranks[r]["topk_vals"].float(), want_vals, rtol=1e-5, atol=1e-5)


def test_row_parallel_layers_hold_their_slice_of_the_input_dim(shards):
    ranks, ckpt = shards
    for name in ("layers.0.mlp.down_proj.weight", "layers.2.self_attn.o_proj.weight"):
        parts = [ranks[r]["params"][name] for r in range(WORLD)]
        assert parts[0].shape[1] * WORLD == ckpt[name].shape[1]
        torch.testing.assert_close(torch.cat(parts, dim=1), ckpt[name], rtol=0, atol=0)


def test_merged_and_qkv_layers_hold_their_slice_of_each_part(shards):
    ranks, ckpt = shards
    for layer in range(dspine_cfg().num_hidden_layers):
        p = f"layers.{layer}."
        for merged, parts in ((p + "mlp.gate_up_proj.weight", ("mlp.gate_proj", "mlp.up_proj")),
                              (p + "self_attn.qkv_proj.weight",
                               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))):
            full = [ckpt[f"{p}{part}.weight"] for part in parts]
            for r in range(WORLD):
                want = torch.cat([f.chunk(WORLD, dim=0)[r] for f in full])
                torch.testing.assert_close(ranks[r]["params"][merged], want, rtol=0, atol=0)


def test_replicated_parameters_are_whole_on_every_rank(shards):
    ranks, ckpt = shards
    for name in ("fc.weight", "transfer.proj.weight", "injections.1.score_proj.weight", "injections.3.gate.bias",
                 "transition.weight", "mask_embedding", "norm.weight", "layers.1.input_layernorm.weight"):
        for r in range(WORLD):
            torch.testing.assert_close(ranks[r]["params"][name], ckpt[name], rtol=0, atol=0)
