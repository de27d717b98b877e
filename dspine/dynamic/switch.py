"""The DSPINE worker's speculation switch: before each decode step, draft a block or decode plainly.

SGLang's static verify graph is a padded executor of one width: a drafting step costs a draft
forward plus an N-token verify per request, whatever the drafter's confidence. The worker has a
second executor, the plain step (`dspine.sglang.plain_step`: K = `plain_tokens` AR decode steps of
the target per request, no draft, SGLang's per-step scheduling paid once). Per step, on the host
and without a device sync, this switch picks the one with more expected tokens per second:

- each running request's expected accepted proposals for a drafting step, E[b] = sum_j S[b, j],
  from the calibrated confidence its last drafted step reported (`observe`, one step late under
  overlap scheduling), or `prior_survival` (the tune split's observed survival) for a request that
  has not drafted yet;
- expected tokens of a drafting step over n requests: n + sum_b E[b]; its time T_round(n) from the
  round table at n·N verify tokens; a plain step emits n·K tokens in T_plain(n) (plain table at n).

A drafting step's loss is loss = T_round(n) - (n + sum_b E[b]) · T_plain(n) / (n·K). While it
loses, the switch decodes plainly for k = ceil(loss / (probe_share · T_plain(n))) steps (at most
`max_backoff`, `backoff_rounds`) and then drafts once (a probe) to refresh the confidences; while it wins, it
drafts. The reference engine's `DynamicVerifier` applies the same rule (K = 1: its plain round is one
token) after each planned round.
Both executors are exact, so outputs do not depend on the switch.

The switch is configured by one JSON file (`SwitchConfig`, written by `dspine tune-sps
--plain-table`), named by `DSPINE_DYNAMIC` in the server's environment:

    {"round_table": "sps_table.json", "plain_table": "plain/sps_table.json", "plain_tokens": 8,
     "calibration": "sts_affine.json", "prior_survival": [0.49, 0.25, ...],
     "probe_share": 0.02, "max_backoff": 1024}

Relative paths are read against the file's folder; `calibration` may be null (raw confidence).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from dspine.dynamic.verification import (
    CostTable,
    PositionCalibration,
    backoff_rounds,
    load_sps_table,
)

SWITCH_FIELDS = ("round_table", "plain_table", "plain_tokens", "calibration", "prior_survival", "probe_share",
                 "max_backoff")


class SwitchConfigError(ValueError):
    """A switch file cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class SwitchConfig:
    """round_table: drafting steps (batch tokens n·N); plain_table: plain steps (read at batch size n) of
    plain_tokens target tokens per request; calibration: per-position calibration of the confidence
    logits (None = raw sigmoid);
    prior_survival [N-1]: non-increasing, in [0, 1]."""

    round_table: CostTable
    plain_table: CostTable
    calibration: PositionCalibration | None
    prior_survival: tuple[float, ...]
    probe_share: float = 0.02
    max_backoff: int = 1024
    plain_tokens: int = 1
    files: dict = field(default_factory=dict, compare=False)

    @classmethod
    def load(cls, path: str | Path) -> "SwitchConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except OSError as err:
            raise SwitchConfigError(f"{path}: cannot read the switch file ({err}); fix DSPINE_DYNAMIC") from None
        except ValueError as err:
            raise SwitchConfigError(f"{path}: not JSON ({err})") from None
        if not isinstance(data, dict):
            raise SwitchConfigError(f"{path}: expected a JSON object with {', '.join(SWITCH_FIELDS)}")
        unknown = set(data) - set(SWITCH_FIELDS)
        missing = {"round_table", "plain_table", "prior_survival"} - set(data)
        if unknown or missing:
            raise SwitchConfigError(f"{path}: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}; "
                                    f"fields are {', '.join(SWITCH_FIELDS)}")

        def table(name: str) -> CostTable:
            file = path.parent / str(data[name])
            try:
                return load_sps_table(file)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise SwitchConfigError(f"{path}: {name} {file}: {err}") from None

        calibration = None
        if data.get("calibration") is not None:
            file = path.parent / str(data["calibration"])
            try:
                calibration = PositionCalibration.load(file)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise SwitchConfigError(f"{path}: calibration {file}: {err}") from None
        prior = data["prior_survival"]
        if (not isinstance(prior, list) or not prior or not all(isinstance(p, (int, float)) for p in prior)
                or any(not 0.0 <= p <= 1.0 for p in prior) or any(b > a for a, b in zip(prior, prior[1:]))):
            raise SwitchConfigError(f"{path}: prior_survival must be a non-empty list of numbers in [0, 1], "
                                    f"non-increasing (the tune split's observed survival per position)")
        if calibration is not None and len(calibration.temperatures) != len(prior):
            raise SwitchConfigError(f"{path}: calibration has {len(calibration.temperatures)} positions but "
                                    f"prior_survival {len(prior)}: both come from one drafter and block size")
        probe_share, max_backoff = data.get("probe_share", 0.02), data.get("max_backoff", 1024)
        plain_tokens = data.get("plain_tokens", 1)
        if not isinstance(plain_tokens, int) or isinstance(plain_tokens, bool) or plain_tokens < 1:
            raise SwitchConfigError(f"{path}: plain_tokens={plain_tokens!r} must be an integer >= 1 (the "
                                    "DSPINE_PLAIN_TOKENS the plain table was measured with)")
        if not isinstance(probe_share, (int, float)) or not 0 < probe_share <= 1:
            raise SwitchConfigError(f"{path}: probe_share={probe_share!r} must lie in (0, 1]")
        if not isinstance(max_backoff, int) or isinstance(max_backoff, bool) or max_backoff < 1:
            raise SwitchConfigError(f"{path}: max_backoff={max_backoff!r} must be an integer >= 1")
        files = {k: data[k] for k in ("round_table", "plain_table", "calibration") if k in data}
        return cls(table("round_table"), table("plain_table"), calibration, tuple(float(p) for p in prior),
                   float(probe_share), max_backoff, plain_tokens, files=files)


def write_switch_file(path: str | Path, *, round_table: str, plain_table: str, calibration: str | None,
                      prior_survival: Sequence[float], probe_share: float = 0.02, max_backoff: int = 1024,
                      plain_tokens: int = 1) -> None:
    """Write a switch file (paths as given: relative ones are read against `path`'s folder) and check
    that it loads, so a bad table or calibration fails here, not in the server."""
    path = Path(path)
    text = json.dumps({"round_table": round_table, "plain_table": plain_table, "plain_tokens": plain_tokens,
                       "calibration": calibration,
                       "prior_survival": [round(float(p), 6) for p in prior_survival],
                       "probe_share": probe_share, "max_backoff": max_backoff}, indent=2) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    try:
        SwitchConfig.load(tmp)
    except SwitchConfigError:
        tmp.unlink()
        raise
    tmp.replace(path)


class ServingSwitch:
    """Per-step draft/plain decisions for one worker (see the module docstring).

    `decide(rids)` -> True to draft, False to decode plainly; `observe(rids, logits)` after a drafted
    step with its raw confidence logits [n, N-1] (host). Counters: `drafted`, `plain` steps."""

    def __init__(self, config: SwitchConfig, block_size: int):
        if len(config.prior_survival) != block_size - 1:
            raise SwitchConfigError(f"the switch's prior_survival has {len(config.prior_survival)} positions but the "
                                    f"drafter proposes {block_size - 1} per block: tune on this drafter")
        if config.plain_tokens > block_size:
            raise SwitchConfigError(f"the switch's plain_tokens={config.plain_tokens} exceeds the block size "
                                    f"{block_size} (SGLang reserves one block of KV slots per request and step): measure the plain "
                                    f"table with DSPINE_PLAIN_TOKENS <= {block_size}")
        self.config, self.block_size = config, int(block_size)
        self.prior_expected = float(sum(config.prior_survival))
        self.expected: dict[str, float] = {}        # rid -> expected accepted proposals of a drafted step
        self.skip, self.probe_due = 0, False
        self.drafted = self.plain = 0
        self._seconds: dict[int, tuple[float, float]] = {}

    def step_seconds(self, n: int) -> tuple[float, float]:
        """(T_round(n), T_plain(n)) from the tables, cached per batch size."""
        if n not in self._seconds:
            gamma = self.block_size - 1
            t_round = float(self.config.round_table.step_seconds(n, torch.tensor([n * gamma]))[0])
            t_plain = float(self.config.plain_table.step_seconds(n, torch.zeros(1, dtype=torch.long))[0])
            self._seconds[n] = (t_round, t_plain)
        return self._seconds[n]

    def loss(self, rids: Sequence[str]) -> tuple[float, float]:
        """(predicted loss of drafting now in seconds, T_plain(n)); loss <= 0: drafting pays."""
        n = len(rids)
        t_round, t_plain = self.step_seconds(n)
        expected = n + sum(self.expected.get(r, self.prior_expected) for r in rids)
        return t_round - expected * t_plain / (n * self.config.plain_tokens), t_plain

    def decide(self, rids: Sequence[str]) -> bool:
        if not rids:
            return True
        self._forget_finished(rids)
        if self.skip > 0:
            self.skip -= 1
            self.plain += 1
            return False
        if self.probe_due:
            self.probe_due = False
            self.drafted += 1
            return True
        loss, t_plain = self.loss(rids)
        k = backoff_rounds(loss, t_plain, self.config.probe_share, self.config.max_backoff)
        if k == 0:
            self.drafted += 1
            return True
        self.skip, self.probe_due = k - 1, True
        self.plain += 1
        return False

    def observe(self, rids: Sequence[str], confidence_logits: Tensor) -> None:
        """A drafted step's raw confidence logits [n, N-1] (row b = rids[b]) -> each request's expected
        accepted proposals for its next drafted step."""
        if confidence_logits.shape != (len(rids), self.block_size - 1):
            raise ValueError(f"confidence logits {tuple(confidence_logits.shape)} for {len(rids)} requests: "
                             f"expected [{len(rids)}, {self.block_size - 1}]")
        logits = confidence_logits.double()
        probs = torch.sigmoid(logits) if self.config.calibration is None else \
            self.config.calibration.probabilities(logits)
        for rid, value in zip(rids, probs.cumprod(-1).sum(-1).tolist()):
            self.expected[rid] = value

    def _forget_finished(self, rids: Sequence[str]) -> None:
        """Keep the memory bounded: past 4x the running batch (and 256), keep the running requests only."""
        if len(self.expected) > max(256, 4 * len(rids)):
            running = set(rids)
            self.expected = {r: v for r, v in self.expected.items() if r in running}

