"""Greedy parity of a speculative server against the AR server, and the speculative ceiling.

Parity: the token ids of each prompt's answer on both servers are compared. At the first differing
position the AR server's top-2 logprob gap decides: a gap of at most `near_tie_nats` is a
"near_tie" divergence, anything else (a larger gap, or no AR logprobs there, e.g. AR stopped) is
"other". The default threshold, 0.25 nats, is two bf16 steps: a small target's top logits (16-32
for SmolLM2) are bf16 numbers 0.125 apart, so a gap of 0, 0.125 or 0.25 means the two best tokens
are adjacent or equal in bf16, and the different accumulation order of an N-token verify against
a 1-token decode flips such choices. A block stores every divergence with its gap, so
`reclassify` can re-judge it at another threshold without measuring.

The prefill check asks the target itself at each divergence: the AR server prefills prompt +
common prefix in one multi-token forward (the kind of forward a verify is) and its greedy next
token is recorded (`picks` "spec", "ar" or "neither"). A divergence whose prefill picks the
speculative server's token is a choice the target's own multi-token forward makes: bf16
forward-mode noise, not a fault of the drafter or the commit path.

Ceiling, from the non-streamed requests of the concurrency-1 level: T_step = AR wall / AR completion
tokens, T_round = spec wall / spec_verify_ct, tau = spec completion tokens / spec_verify_ct,
speedup = tau * T_step / T_round.
"""

from __future__ import annotations

from dspine.bench.chat_client import Reply, prefill_next_token
from dspine.bench.results import BenchError

PARITY_KEYS = ("parity", "parity_ablation", "parity_ar_control")
NEAR_TIE_NATS = 0.25   # the default threshold: two bf16 steps of a small target's top logits (above)
# The server returns fp32 logprobs, so a gap of exactly two bf16 steps can arrive as 0.25000006.
LOGPROB_GAP_TOLERANCE = 1e-5


def verdict(gap: float | None, near_tie_nats: float) -> str:
    """"near_tie" when the AR server's top-2 gap at the divergence is at most `near_tie_nats`
    (up to fp32 rounding of the logprobs, `LOGPROB_GAP_TOLERANCE`)."""
    return "near_tie" if gap is not None and gap <= near_tie_nats + LOGPROB_GAP_TOLERANCE else "other"


def classify(ar: Reply, spec: Reply, near_tie_nats: float) -> dict:
    """`{"kind": "identical"|"near_tie"|"other", "position", "gap"}` for one prompt: the first
    position where the token ids differ and the AR server's top-2 logprob gap there."""
    a, b = ar.token_ids or [], spec.token_ids or []
    if a == b:
        return {"kind": "identical", "position": None, "gap": None}
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    top = ar.top2[k] if ar.top2 and k < len(ar.top2) else []
    gap = top[0] - top[1] if len(top) >= 2 else None
    return {"kind": verdict(gap, near_tie_nats), "position": k, "gap": gap}


def gap_histogram(divergences: list[dict]) -> dict[str, int]:
    """Divergences per AR top-2 gap (nats, 3 decimals; "none" where the AR server had no logprobs)."""
    counts: dict[str, int] = {}
    for d in divergences:
        key = "none" if d["gap"] is None else f"{d['gap']:.3f}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def summarize_parity(prompts: int, divergences: list[dict], near_tie_nats: float) -> dict:
    """The schema's counts for `divergences` (each with its "gap") judged at `near_tie_nats`."""
    divergences = [{**d, "kind": verdict(d["gap"], near_tie_nats)} for d in divergences]
    kinds = [d["kind"] for d in divergences]
    return {
        "prompts": prompts,
        "identical": prompts - len(divergences),
        "near_tie_divergences": kinds.count("near_tie"),
        "other_divergences": kinds.count("other"),
        "near_tie_nats": near_tie_nats,
        "gap_histogram": gap_histogram(divergences),
        "divergences": divergences,
    }


def parity_summary(ar: list[Reply], spec: list[Reply], prompts: list[dict], near_tie_nats: float) -> dict:
    """The schema's parity counts, plus each divergence (prompt id, position, gap)."""
    verdicts = [classify(a, s, near_tie_nats) for a, s in zip(ar, spec)]
    divergences = [{"id": p["id"], **v} for p, v in zip(prompts, verdicts) if v["kind"] != "identical"]
    return summarize_parity(len(verdicts), divergences, near_tie_nats)


def prefill_check(base: str, ar: list[Reply], other: list[Reply], block: dict, prompts: list[dict],
                  timeout: float) -> dict:
    """Add `prefill` to every divergence of `block` (a parity summary of `ar` against `other`,
    prompt order) and `prefill_picks` to the block: which side the AR server's one-pass prefill of
    prompt + common prefix takes at the divergence ("spec" = `other`'s token, "ar", "neither")."""
    index = {p["id"]: i for i, p in enumerate(prompts)}
    picks = {"spec": 0, "ar": 0, "neither": 0}
    for d in block["divergences"]:
        a, b = ar[index[d["id"]]], other[index[d["id"]]]
        if a.prompt_token_ids is None:
            raise BenchError("the AR server returned no choices[0].prompt_token_ids with return_token_ids "
                             "(SGLang >= 0.5.17 does): --prefill-check needs them")
        k = d["position"]
        got = prefill_next_token(base, a.prompt_token_ids + a.token_ids[:k], timeout)
        ar_token = a.token_ids[k] if k < len(a.token_ids) else None
        spec_token = b.token_ids[k] if k < len(b.token_ids) else None
        side = "spec" if got["token"] == spec_token else "ar" if got["token"] == ar_token else "neither"
        picks[side] += 1
        d["prefill"] = {**got, "ar_token": ar_token, "spec_token": spec_token, "picks": side}
    block["prefill_picks"] = picks
    return block


def reclassify(results: dict, near_tie_nats: float) -> dict:
    """`results` with every parity block re-judged at `near_tie_nats` from its stored gaps (the
    measurement is unchanged; the threshold used before is kept as `measured_near_tie_nats`)."""
    for key in PARITY_KEYS:
        block = results.get(key)
        if not block or "divergences" not in block:
            continue
        first = block.get("measured_near_tie_nats", block.get("near_tie_nats"))
        results[key] = {**block, **summarize_parity(block["prompts"], block["divergences"], near_tie_nats),
                        "measured_near_tie_nats": first}
    results.setdefault("settings", {})["near_tie_nats"] = near_tie_nats
    return results


def ceiling(ar: list[Reply], spec: list[Reply]) -> dict:
    """T_step from the AR server's, T_round and tau from the DSPINE server's non-streamed requests
    of the concurrency-1 level (one request at a time, same request shape on both)."""
    verify = sum(r.meta_info.get("spec_verify_ct") or 0 for r in spec)
    if not verify:
        raise BenchError("the DSPINE server returned no meta_info.spec_verify_ct: cannot measure T_round or tau")
    tokens = sum(r.completion_tokens for r in spec)
    t_step = sum(r.wall_s for r in ar) / sum(r.completion_tokens for r in ar)
    t_round = sum(r.wall_s for r in spec) / verify
    tau = tokens / verify
    return {"t_step_ms": t_step * 1e3, "t_round_ms": t_round * 1e3, "accept_len": tau,
            "speedup": tau * t_step / t_round}
