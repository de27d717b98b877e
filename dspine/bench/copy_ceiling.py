"""How far copy candidates can go on a workload, in the reference engine (greedy, fp32).

    python -m dspine.bench.copy_ceiling --agentic agentic_coding.jsonl --max-new-tokens 256

Runs the drafter (default: the shipped one) twice over each workload's prompts: with copy
candidates on, recording every round (the block the lattice proposed, each copy chain, the
drafter's per-slot argmax), and with them off, for its tau. Greedy speculative decoding returns the
target's own answer, so afterwards each round's true continuation is known and any proposal's
accepted length a_r in that round is its agreement with it. Kinds (over the rounds whose whole
continuation is known):

- `lattice`: what was proposed;
- `chain_<c>`: copy chain c alone; `argmax`: the drafter's per-slot argmax alone;
- `copy_walk`: a lookup that matches again after every true token (the copy settings' longest
  most recent match, its first token);
- `tree_chains`: the longest of the lattice's block and the chains, as if verified together;
  `tree_walk`: the longer of the lattice's block and the copy walk;
- `union`: one chain taking at every slot whichever of the copy walk's token and the drafter's
  argmax is right (a lattice that always chooses right between those two sources).

A kind's tau is estimated on the trajectory it would take, not per recorded round: round r of the
run covered c_r = a_lattice_r + 1 tokens, which the kind would cover in about c_r / (a_r + 1) of its
own rounds, so tau = sum(c_r) / sum(c_r / (a_r + 1)) (the lattice's own tau for `lattice`). A plain
mean of a_r + 1 over the recorded rounds would overweight gains where the lattice is already fast
(few rounds there; `benchmarks/results/copy_walk_cpu.json` sets both estimates beside a real run).
Single-round counterfactuals still: the kinds are judged at the lattice's anchors. `union` and `tree_walk` indicate what one proposed chain mixing this drafter
with copies from the request's own context, or a copy branch verified beside the block, could reach
on this workload.
Prints a table and writes `--out` JSON: `{"target", "drafter", "device", "date", "command", "torch",
"max_new_tokens", "workloads": {name: {"prompts", "rounds", "complete_rounds", "tau_nocopy",
"tau_copy", "parity", "ceiling": {kind: tau}}}}`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from dspine.engine.proposer import DSpineProposer, Proposal
from dspine.model.copy_candidates import find_copies
from dspine.model.drafter import DSpineDrafter


@dataclass
class Round:
    """One recorded round of a row: prompt index, the anchor token and its position in prompt +
    answer, the proposed block [N], the copy chains [C][N] (-1: none) and the drafter's per-slot
    argmax [N]."""

    prompt: int
    anchor: int
    anchor_pos: int
    proposed: list[int]
    chains: list[list[int]]
    argmax: list[int]


class RecordingProposer(DSpineProposer):
    """`DSpineProposer` that records every round (`rounds`) with the prompt index of each row
    (rows start as prompts start, `prompt_offset` onward, and follow `select`)."""

    def __init__(self, model: DSpineDrafter):
        super().__init__(model)
        self.rounds: list[Round] = []
        self.prompt_offset = 0
        self._rows: Tensor | None = None
        self._last: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None

    def start(self, tokens: Tensor, hidden: Tensor, lengths: Tensor) -> None:
        super().start(tokens, hidden, lengths)
        self._rows = torch.arange(self.prompt_offset, self.prompt_offset + tokens.shape[0])
        self.prompt_offset += tokens.shape[0]

    def select(self, rows: Tensor) -> None:
        super().select(rows)
        self._rows = self._rows[rows.cpu()]

    def draft(self, anchor_ids: Tensor):
        hidden, logits, copies = super().draft(anchor_ids)
        self._last = (anchor_ids.clone(), self.lengths.clone(), logits.argmax(-1),
                      None if copies is None else copies.ids)
        return hidden, logits, copies

    def propose(self, anchor_ids: Tensor, temperature: Tensor, generator: torch.Generator | None) -> Proposal:
        proposal = super().propose(anchor_ids, temperature, generator)
        anchors, lengths, argmax, chains = self._last
        for b in range(anchor_ids.shape[0]):
            self.rounds.append(Round(int(self._rows[b]), int(anchors[b]), int(lengths[b]), proposal.tokens[b].tolist(),
                                     [] if chains is None else chains[b].tolist(), argmax[b].tolist()))
        return proposal


def agreement(tokens: list[int], truth: list[int]) -> int:
    """How many leading tokens of `tokens` equal `truth`'s (a -1 never does)."""
    n = 0
    for a, b in zip(tokens, truth):
        if a < 0 or a != b:
            break
        n += 1
    return n


def copy_walk(sequence: list[int], anchor_pos: int, truth: list[int], argmax: list[int], cfg) -> tuple[int, int]:
    """Accepted lengths of (the walk, the union) at one round. The walk proposes at each slot j the
    first copy token of the history sequence[:anchor_pos + 1] + truth[:j] (`find_copies` with
    `cfg`'s copy settings); the union takes slot j when the walk's token or the drafter's argmax[j]
    is right: the most a single chain drawing every slot from those two could accept."""
    walk = union = 0
    for j, token in enumerate(truth):
        history = torch.tensor([sequence[:anchor_pos + 1] + truth[:j]])
        ids, _ = find_copies(history, torch.tensor([history.shape[1]]), cfg, 1)
        copied = int(ids[0, 0]) == token
        walk += int(copied and walk == j)
        if not (copied or argmax[j] == token):
            break
        union += 1
    return walk, union


@dataclass
class Ceiling:
    """Per-kind trajectory estimates (module docstring): `tokens` = sum of c_r over complete rounds,
    `rounds[kind]` = sum of c_r / (a_r + 1); `tau()` = tokens / rounds per kind."""

    recorded: int = 0
    complete: int = 0
    tokens: int = 0
    rounds: dict[str, float] = field(default_factory=dict)

    def add_round(self, covered: int, accepted: dict[str, int]) -> None:
        """One complete round that covered `covered` tokens; accepted: kind -> a_r."""
        self.complete += 1
        self.tokens += covered
        for kind, a in accepted.items():
            self.rounds[kind] = self.rounds.get(kind, 0.0) + covered / (a + 1)

    def tau(self) -> dict[str, float]:
        return {k: self.tokens / v for k, v in self.rounds.items()}


def measure_rounds(rounds: list[Round], sequences: list[list[int]], cfg, walk: bool = True) -> Ceiling:
    """The ceiling kinds (module docstring) of recorded `rounds` against the final prompt + answer
    `sequences` (indexed by prompt); rounds whose continuation is cut by the answer's end count in
    `recorded` only. `walk`: also the copy walk (a suffix match per slot: the slow part). Raises
    ValueError when a round's anchor is not its sequence's token there (rows mixed up)."""
    out = Ceiling()
    for r in rounds:
        if sequences[r.prompt][r.anchor_pos] != r.anchor:
            raise ValueError(f"a round of prompt {r.prompt} anchors on {r.anchor} at {r.anchor_pos}, where its "
                             f"sequence holds {sequences[r.prompt][r.anchor_pos]}")
        out.recorded += 1
        n = len(r.proposed)
        truth = sequences[r.prompt][r.anchor_pos + 1: r.anchor_pos + 1 + n]
        if len(truth) < n:
            continue
        lattice = agreement(r.proposed, truth)
        chains = [agreement(c, truth) for c in r.chains]
        accepted = {"lattice": lattice, "argmax": agreement(r.argmax, truth),
                    **{f"chain_{c}": a for c, a in enumerate(chains)}, "tree_chains": max([lattice] + chains)}
        if walk:
            walked, union = copy_walk(sequences[r.prompt], r.anchor_pos, truth, r.argmax, cfg)
            accepted.update(copy_walk=walked, tree_walk=max(lattice, walked), union=union)
        out.add_round(lattice + 1, accepted)
    return out


def measure_workload(target, drafter: DSpineDrafter, prompts: list[list[int]], *, max_new_tokens: int,
                     stop_token_ids: list[int], batch_size: int, walk: bool = True) -> dict:
    """One workload: the no-copy run, the recorded copy run and the ceiling of its rounds (the
    drafter's `copy_candidates` is switched for the two runs and restored)."""
    from dspine.engine.generate import generate

    common = dict(max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, batch_size=batch_size)
    shipped = drafter.config.copy_candidates
    try:
        drafter.config.copy_candidates = False
        off = generate(target, drafter, prompts, **common)
        drafter.config.copy_candidates = True
        proposer = RecordingProposer(drafter)
        on = generate(target, proposer, prompts, **common)
    finally:
        drafter.config.copy_candidates = shipped
    sequences = [p + a for p, a in zip(prompts, on.tokens)]
    ceiling = measure_rounds(proposer.rounds, sequences, drafter.config, walk)
    return {"prompts": len(prompts), "rounds": ceiling.recorded, "complete_rounds": ceiling.complete,
            "tau_nocopy": off.stats.tau, "tau_copy": on.stats.tau,
            "parity": sum(a == b for a, b in zip(off.tokens, on.tokens)),
            "ceiling": ceiling.tau()}


def table(workloads: dict) -> str:
    kinds = list(dict.fromkeys(k for w in workloads.values() for k in w["ceiling"]))
    lines = [f"{'workload':<18}{'no copy':>9}{'copy':>8}" + "".join(f"{k:>13}" for k in kinds)]
    for name, w in workloads.items():
        lines.append(f"{name:<18}{w['tau_nocopy']:>9.3f}{w['tau_copy']:>8.3f}"
                     + "".join(f"{w['ceiling'].get(k, float('nan')):>13.3f}" for k in kinds))
    lines.append("(tau: tokens per round; the kinds estimated on their own trajectories from the rounds whose whole "
                 "continuation is known)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from dspine.data.eval_sets import EVAL_SETS
    from dspine.train.cli import add_prompt_folder_arguments

    p = argparse.ArgumentParser(prog="python -m dspine.bench.copy_ceiling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example:\n  python -m dspine.bench.copy_ceiling --agentic agentic_coding.jsonl "
                                       "--datasets gsm8k --max-new-tokens 256 --out ceiling.json")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one); its copy settings "
                                                   "and tables are used, copy candidates switched on and off")
    p.add_argument("--target", default=None, help="target (default: the bundled SmolLM2-135M-Instruct)")
    add_prompt_folder_arguments(p)
    p.add_argument("--datasets", nargs="*", default=[], choices=list(EVAL_SETS))
    p.add_argument("--agentic", nargs="*", default=[], metavar="FILE",
                   help="agentic trace files (python -m dspine.data.agentic DIR writes them), one workload each")
    p.add_argument("--agentic-split", choices=("tune", "heldout", "all"), default="heldout")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per workload")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--no-walk", action="store_true", help="skip the copy walk (a suffix match per slot and round)")
    p.add_argument("--out", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    if not args.datasets and not args.agentic:
        p.error("give at least one workload: --agentic FILE or --datasets NAME")
    return args


def main(argv: list[str] | None = None) -> int:
    from dspine.bench.accept import device_name, workloads
    from dspine.engine.targets import load_target, stop_token_ids
    from dspine.model.checkpoint import default_drafter_dir, load_checkpoint

    args = parse_args(argv)
    target, tokenizer = load_target(args.target, dtype=torch.float32, device="cpu")
    drafter_dir = args.drafter or default_drafter_dir()
    drafter = load_checkpoint(drafter_dir, target=target, device="cpu", dtype=torch.float32)
    if drafter.config.selection != "transition":
        raise SystemExit(f"copy_ceiling: {drafter_dir} selects by argmax; copy candidates need the transition lattice")
    results = {}
    for name, prompts in workloads(args, tokenizer):
        results[name] = measure_workload(target, drafter, prompts, max_new_tokens=args.max_new_tokens,
                                         stop_token_ids=stop_token_ids(tokenizer, target),
                                         batch_size=args.batch_size, walk=not args.no_walk)
        print(f"{name}: tau {results[name]['tau_nocopy']:.3f} -> {results[name]['tau_copy']:.3f}; ceiling "
              + ", ".join(f"{k} {v:.3f}" for k, v in results[name]["ceiling"].items()), flush=True)
    print(table(results))
    if args.out:
        record = {"target": args.target or "smollm2-135m-instruct", "drafter": str(drafter_dir),
                  "device": device_name("cpu"), "torch": torch.__version__,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["python -m dspine.bench.copy_ceiling", *map(shlex.quote, sys.argv[1:])]), "max_new_tokens": args.max_new_tokens,
                  "workloads": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
