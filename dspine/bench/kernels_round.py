"""Kernel benchmark, the draft round and the verify: `DSpineProposer.propose` of DSpine (per-layer
and first-layer candidates) vs the ablation (no injection, argmax selection), and a 16-token verify
of a target of the same shape for the verify-inclusive ratio."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspine.bench.kernels_harness import GB, Run, Settings
from dspine.engine.proposer import DSpineProposer
from dspine.kernels import dispatch
from dspine.model.config import DSpineConfig
from dspine.model.drafter import DSpineDrafter


def drafter_config(cfg: Settings, shape: dict, **overrides) -> DSpineConfig:
    return DSpineConfig(hidden_size=shape["hidden"], vocab_size=shape["vocab"], num_attention_heads=shape["heads"],
                        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                        intermediate_size=shape["ffn"], num_target_layers=shape["target_layers"], mask_token_id=0,
                        num_hidden_layers=cfg.draft_layers, block_size=cfg.block, transfer_rank=cfg.rank,
                        injection_top_k=cfg.top_k, selection_top_k=cfg.top_k,
                        sliding_window=max(2048, 2 * cfg.context), max_position_embeddings=max(8192, 4 * cfg.context),
                        **overrides)


class Round:
    """One drafter (DSpine or ablation) with a proposer holding a `context`-token context per row."""

    def __init__(self, cfg: Settings, shape: dict, embeddings: tuple, bs: int, ablation: bool, seed: int = 0,
                 candidates: str = "per_layer"):
        torch.manual_seed(seed)
        self.cfg = cfg
        config = drafter_config(cfg, shape, **({"injection": False, "selection": "argmax"} if ablation
                                               else {"injection_candidates": candidates}))
        with torch.device(cfg.device):
            self.model = DSpineDrafter(config).to(cfg.dtype).eval()
        with torch.no_grad():  # no all-zero parameters in what we time
            self.model.mask_embedding.normal_()
            if self.model.transition is not None:
                self.model.transition.weight.normal_(std=cfg.rank**-0.5)
        self.model.attach_target(*embeddings)
        self.proposer = DSpineProposer(self.model)
        self.proposer.successors = None  # pair scores on the fly: the lazy table syncs with the host
        self.resize(bs)

    @torch.no_grad()
    def resize(self, bs: int) -> None:
        config, device, context = self.model.config, self.cfg.device, self.cfg.context
        g = torch.Generator(device=device).manual_seed(bs)
        tokens = torch.randint(0, config.vocab_size, (bs, context), generator=g, device=device)
        hidden = torch.randn(bs, context, config.num_context_features * config.hidden_size, generator=g,
                             device=device).to(self.cfg.dtype)
        self.proposer.start(tokens, hidden, torch.full((bs,), context, device=device))
        self.anchor = torch.randint(0, config.vocab_size, (bs,), generator=g, device=device)
        self.temperature = torch.zeros(bs, device=device)

    @torch.no_grad()
    def propose(self):
        return self.proposer.propose(self.anchor, self.temperature, None)


def round_section(run: Run, shape_name: str, shape: dict) -> dict:
    """Draft-round ms per bs: {bs: (dspine_ms, ablation_ms, dspine_first_layer_ms)}."""
    cfg = run.cfg
    g = torch.Generator(device=cfg.device).manual_seed(7)
    embeddings = tuple(torch.randn(shape["vocab"], shape["hidden"], generator=g, device=cfg.device).to(cfg.dtype)
                       for _ in range(2))
    out = {}
    try:
        dspine = Round(cfg, shape, embeddings, cfg.batches[0], ablation=False)
        ablation = Round(cfg, shape, embeddings, cfg.batches[0], ablation=True)
        first = Round(cfg, shape, embeddings, cfg.batches[0], ablation=False, candidates="first_layer")
        for bs in cfg.batches:
            if run.remaining() < 30:
                run.details["notes"].append(f"round {shape_name} bs={bs} skipped: out of budget")
                break
            for r in (dspine, ablation, first):
                r.resize(bs)
            d_ms, a_ms, f_ms = (run.bench_ms(r.propose) for r in (dspine, ablation, first))
            out[bs] = (d_ms, a_ms, f_ms)
            run.results["round"].append({"shape": shape_name, "bs": bs, "dspine_ms": round(d_ms, 4),
                                         "ablation_ms": round(a_ms, 4), "dspine_first_layer_ms": round(f_ms, 4)})
            run.log(f"  round {shape_name:<13} bs={bs:<3} DSpine {d_ms:8.4f} ms  first-layer {f_ms:8.4f} ms  "
                    f"ablation {a_ms:8.4f} ms  ratios {d_ms / a_ms:5.3f} / {f_ms / a_ms:5.3f}")
            run.save()
            if not cfg.smoke:  # the same round with the PyTorch references in place of the kernels
                with dispatch.forced("torch"):
                    t_ms = run.bench_ms(dspine.propose)
                run.details["round_torch_kernels"].append({"shape": shape_name, "bs": bs, "dspine_torch_ms": t_ms})
                run.log(f"  round {shape_name:<13} bs={bs:<3} DSpine with torch references {t_ms:8.4f} ms")
                run.save()
    except Exception as exc:  # noqa: BLE001
        run.record_error(f"round {shape_name}", exc)
    return out


class LeanTarget:
    """A Llama/Qwen3-shaped target without the frills (no RoPE, no q/k norms, no mask): per layer
    RMSNorm, fused QKV GEMM, KV-cache write, SDPA over the context + block, O GEMM, RMSNorm,
    fused gate/up GEMM, SiLU·up, down GEMM; then the lm_head. A lower bound of a real verify."""

    def __init__(self, cfg: Settings, shape: dict, bs: int, tokens: int, seed: int = 0):
        device = cfg.device
        g = torch.Generator(device=device).manual_seed(seed)
        hd, nh, nkv, hidden = shape["head_dim"], shape["heads"], shape["kv_heads"], shape["hidden"]

        def rnd(*size):
            return (torch.randn(*size, generator=g, device=device) * 0.02).to(cfg.dtype)

        self.cfg, self.shape, self.tokens = cfg, shape, tokens
        self.layers = [dict(qkv=rnd((nh + 2 * nkv) * hd, hidden), o=rnd(hidden, nh * hd),
                            gate_up=rnd(2 * shape["ffn"], hidden), down=rnd(hidden, shape["ffn"]),
                            norm1=torch.ones(hidden, device=device, dtype=cfg.dtype),
                            norm2=torch.ones(hidden, device=device, dtype=cfg.dtype))
                       for _ in range(shape["target_layers"])]
        self.lm_head = rnd(shape["vocab"], hidden)
        self.resize(bs)

    def resize(self, bs: int) -> None:
        s, cfg = self.shape, self.cfg
        self.kv = [torch.randn(2, bs, s["kv_heads"], cfg.context + self.tokens, s["head_dim"],
                               device=cfg.device).to(cfg.dtype) for _ in self.layers]
        self.x = torch.randn(bs, self.tokens, s["hidden"], device=cfg.device).to(cfg.dtype)

    @torch.no_grad()
    def forward(self) -> torch.Tensor:
        s, x, context = self.shape, self.x, self.cfg.context
        bs, t, hidden = x.shape
        hd, nh, nkv = s["head_dim"], s["heads"], s["kv_heads"]
        for w, kv in zip(self.layers, self.kv):
            qkv = F.rms_norm(x, (hidden,), w["norm1"]) @ w["qkv"].T
            q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            kv[0, :, :, context:].copy_(k.view(bs, t, nkv, hd).transpose(1, 2))
            kv[1, :, :, context:].copy_(v.view(bs, t, nkv, hd).transpose(1, 2))
            o = F.scaled_dot_product_attention(q.view(bs, t, nh, hd).transpose(1, 2), kv[0], kv[1], enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(bs, t, nh * hd) @ w["o"].T
            gate, up = (F.rms_norm(x, (hidden,), w["norm2"]) @ w["gate_up"].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w["down"].T
        return x @ self.lm_head.T

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.layers for t in w.values()) + \
            self.lm_head.numel() * self.lm_head.element_size()


def verify_section(run: Run, shape_name: str, shape: dict, rounds: dict) -> None:
    cfg = run.cfg
    try:
        target = LeanTarget(cfg, shape, cfg.batches[0], cfg.block)
        for bs in cfg.batches:
            if run.remaining() < 20:
                run.details["notes"].append(f"verify {shape_name} bs={bs} skipped: out of budget")
                break
            target.resize(bs)
            v_ms = run.bench_ms(target.forward)
            floor_ms = target.weight_bytes() / (run.results["copy_bandwidth_gbs"] * GB) * 1e3
            entry = {"shape": shape_name, "bs": bs, "tokens": cfg.block, "context": cfg.context,
                     "verify_ms": round(v_ms, 4), "weight_bytes_floor_ms": round(floor_ms, 4)}
            if bs in rounds:
                d_ms, a_ms, f_ms = rounds[bs]
                entry.update(dspine_round_ms=round(d_ms, 4), ablation_round_ms=round(a_ms, 4),
                             round_ratio=round(d_ms / a_ms, 4),
                             verify_inclusive_ratio=round((v_ms + d_ms) / (v_ms + a_ms), 4),
                             first_layer_round_ms=round(f_ms, 4), first_layer_round_ratio=round(f_ms / a_ms, 4),
                             first_layer_verify_inclusive_ratio=round((v_ms + f_ms) / (v_ms + a_ms), 4))
            run.results["verify"].append(entry)
            run.log(f"  verify {shape_name:<13} bs={bs:<3} {v_ms:8.4f} ms  {entry}")
            run.save()
    except Exception as exc:  # noqa: BLE001
        run.record_error(f"verify {shape_name}", exc)
