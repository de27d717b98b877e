"""What a saved training state must match to be continued, and the RNG state it carries.

A run directory's `state.pt` holds the model, the optimizer, the step, the log, every RNG state and
the run's key:

    {"config": {field: value} of RESUME_FIELDS, "config_hash": 16 hex digits of those fields,
     "target": the target's fingerprint (`targets.target_identity`),
     "data": 16 hex digits of the data file's bytes, "records": its usable sequence count}

The data position is a function of (seed, step, batch shape, records): `SequenceSampler` draws
batches by position, so the same key and step give the same next batch on any host. Resuming with
a different key would silently train another run, so `check` refuses it and names each difference;
`--warm-start` instead keeps only the saved weights and starts a fresh optimizer, schedule and log
(the log records what it started from). When only the data file differs (a campaign's data grew),
`--new-data` goes on with everything but the data: batches are drawn from the new file from the
saved step on; `RUN_DIR/data_changes.json` lists each change.

A travel state (`travel_state`, `python -m dspine.train.resume travel STATE OUT`) is the same dict
without the optimizer: the fp32 weights, step, log, RNG states and key, a third of the size (76 MB
instead of 228 MB for the SmolLM2 drafter), for carrying a run between hosts that take files in
16-MiB pieces. Resuming from it continues the same run (same key, step, schedule and data position)
with AdamW's moments restarted from zero; the trainer says so when it resumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import random
from pathlib import Path

import torch

from dspine.train.config import TrainConfig, TrainConfigError
from dspine.utils.atomic import write_atomic

# TrainConfig fields that change what a step computes or which data it sees. Not in it: where files
# go (run_dir, data: its content is hashed instead), how often to evaluate, save and log, the export
# shard size, `compile`, `cudnn_attention` and `flex_attention` (the same arithmetic: fused, another
# backend, or masked tiles skipped), and `steps`: a campaign may be lengthened or shortened between
# sessions (the cosine schedule then decays toward the new end from the step it resumes at).
NOT_RESUME_FIELDS = ("run_dir", "data", "eval_every", "save_every", "log_every", "export_shard_bytes", "compile",
                     "compile_target", "cudnn_attention", "flex_attention", "steps")
RESUME_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in NOT_RESUME_FIELDS)


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def file_digest(path: str | Path) -> str:
    """16 hex digits of the file's bytes (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()[:16]


def run_key(cfg: TrainConfig, target_fingerprint: str, records: int) -> dict:
    """The key of a run (module docstring)."""
    fields = {name: getattr(cfg, name) for name in RESUME_FIELDS}
    return {"config": fields, "config_hash": _digest(json.dumps(fields, sort_keys=True, default=str).encode()),
            "target": target_fingerprint, "data": file_digest(cfg.data), "records": int(records)}


def differences(saved: dict, current: dict) -> list[str]:
    """What differs between two run keys, one phrase each (config fields by name)."""
    found = []
    old_cfg, new_cfg = saved.get("config", {}), current["config"]
    for name in sorted(set(old_cfg) | set(new_cfg)):
        if old_cfg.get(name) != new_cfg.get(name):
            found.append(f"config {name}: saved {old_cfg.get(name)!r}, now {new_cfg.get(name)!r}")
    if saved.get("target") != current["target"]:
        found.append(f"target fingerprint: saved {saved.get('target')}, now {current['target']}")
    if saved.get("data") != current["data"] or saved.get("records") != current["records"]:
        found.append(f"data: saved {saved.get('data')} ({saved.get('records')} sequences), now "
                     f"{current['data']} ({current['records']} sequences)")
    return found


def check(saved: dict | None, current: dict, *, state_file: Path, warm_start: bool, new_data: bool = False) -> str:
    """"resume", "new-data" or "warm-start" for a run whose `state_file` holds `saved` (None: a state
    written without a key); TrainConfigError naming every difference and the fixes otherwise.
    "new-data": only the data file differs and `new_data` allows it (the run goes on, optimizer and
    schedule included, drawing its batches from the new file)."""
    found = ["the saved state has no run key"] if saved is None else differences(saved, current)
    if not found:
        return "resume"
    only_data = saved is not None and found == [f for f in found if f.startswith("data:")]
    if new_data and only_data:
        return "new-data"
    if warm_start:
        return "warm-start"
    more = " or --new-data to go on with this data file (same optimizer and schedule)" if only_data else ""
    raise TrainConfigError(f"{state_file} belongs to another run: " + "; ".join(found) + ". Fix: train with the "
                           "saved config, target and data to resume, pass --warm-start to start a new schedule "
                           f"from the saved weights{more}, or use another --run-dir")


def rng_state() -> dict:
    """Every RNG a step may draw from: Python's, torch's CPU generator and each CUDA device's."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def travel_state(state: dict) -> dict:
    """`state` (a `state.pt` dict) without its optimizer: what resuming needs besides AdamW's moments."""
    return {name: value for name, value in state.items() if name != "optimizer"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dspine.train.resume",
        description="A run's saved state, for another host or as a checkpoint. `travel`: its state.pt without the "
                    "optimizer's moments (a third of the size); put it in place of RUN_DIR/state.pt (with "
                    "run_key.json beside it) on another host and `dspine train` resumes it at the same step with "
                    "AdamW's moments restarted. `export`: the drafter checkpoint of a state (full or travel), as "
                    "its run would have exported it at that step.")
    sub = p.add_subparsers(dest="command", required=True)
    travel = sub.add_parser("travel", help="STATE -> OUT without the optimizer")
    travel.add_argument("state", type=Path, help="a run's state.pt")
    travel.add_argument("out", type=Path, help="the travel state to write (e.g. .gpu-state/state.pt)")
    export = sub.add_parser("export", help="STATE -> a drafter checkpoint folder OUT (bench-accept, serving)")
    export.add_argument("state", type=Path, help="a run's state.pt or a travel state")
    export.add_argument("out", type=Path, help="the checkpoint folder to write (replaced if it exists)")
    export.add_argument("--target", default=None,
                        help="the target the run trained against: a folder or hub id (default: the packaged "
                             "SmolLM2-135M-Instruct); its fingerprint must match the state's")
    export.add_argument("--trained-on", default="unknown device", metavar="NAME",
                        help="the device the run trained on, for the model card (e.g. 'NVIDIA H200'): a state "
                             "does not record it")
    export.add_argument("--steps", type=int, default=None,
                        help="the run's schedule length, for the checkpoint's config (default: the state's step, "
                             "i.e. a finished run)")
    args = p.parse_args(argv)
    if not args.state.is_file():
        p.error(f"{args.state} is not a file: name a run directory's state.pt")
    state = torch.load(args.state, map_location="cpu", weights_only=False)
    if "model" not in state or "step" not in state:
        p.error(f"{args.state} is not a training state (it has no model weights and step)")
    if args.command == "export":
        try:
            from dspine.train.export import export_state

            path = export_state(state, args.out, args.target, args.trained_on, args.steps)
        except TrainConfigError as e:
            p.error(str(e))
        print(f"{path}: the drafter at step {state['step']}")
        return 0
    lean = travel_state(state)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda f: None, check=lambda tmp: torch.save(lean, tmp))
    print(f"{args.out}: step {state['step']}, {args.out.stat().st_size / 1e6:.1f} MB "
          f"(from {args.state.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
