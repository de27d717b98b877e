"""The DSPINE worker's speculation switch: before each decode step, draft a block or decode plainly.

SGLang's static verify graph is a padded executor of one width: a drafting step costs a draft
forward plus an N-token verify per request, whatever the drafter's confidence. The worker has a
second executor, the plain step (`dspine.sglang.plain_step`: K = `plain_tokens` AR decode steps of
the target per request, no draft, SGLang's per-step scheduling paid once). Per step, on the host
and without a device sync, this switch picks one by the draft-or-plain rule (`dspine.dynamic.backoff`)
with this estimate of a drafting step over n requests:

- each running request's expected accepted proposals E[b] = sum_j S[b, j], from the calibrated
  confidence its last drafted step reported (`observe`, one step late under overlap scheduling),
  or `prior_survival` (the tune split's observed survival) for a request that has not drafted yet;
- expected tokens n + sum_b E[b]; time T_round(n) from the round table at n·N verify tokens; a
  plain step emits n·K tokens in T_plain(n) (plain table at n).

Both executors are exact, so outputs do not depend on the switch.

A switch file, named by `DSPINE_DYNAMIC` in the server's environment, is one of two JSON objects:

- the dynamic switch (`SwitchConfig`, written by `dspine tune-sps --plain-table`):

      {"round_table": "sps_table.json", "plain_table": "plain/sps_table.json", "plain_tokens": 8,
       "calibration": "sts_affine.json", "prior_survival": [0.49, 0.25, ...],
       "probe_share": 0.02, "max_backoff": 1024}

  relative paths are read against the file's folder; `calibration` may be null (raw confidence);
- a forced switch (`ForcedSwitch`, `write_forced_switch`): `{"force": "plain", "plain_tokens": K}`
  makes every decode step a K-token plain step (how the plain table is measured), `{"force":
  "draft"}` every step a drafting one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from dspine.dynamic.backoff import BackoffRule, DraftEstimate, DraftOrPlain
from dspine.dynamic.calibration import PositionCalibration
from dspine.dynamic.cost_tables import CostTable, load_sps_table
from dspine.utils.atomic import write_json_atomic

SWITCH_FIELDS = ("round_table", "plain_table", "plain_tokens", "calibration", "prior_survival", "probe_share",
                 "max_backoff")
FORCED_FIELDS = ("force", "plain_tokens")
FORCED_STEPS = ("plain", "draft")


class SwitchConfigError(ValueError):
    """A switch file cannot be used; the message names the file, the field and the fix."""


def _plain_tokens(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SwitchConfigError(f"{where}: plain_tokens={value!r} must be an integer >= 1 (target tokens per plain "
                                "step; a plain table is measured with the plain_tokens of its forced switch file)")
    return value


@dataclass(frozen=True)
class ForcedSwitch:
    """Every decode step one kind: `force` "plain" (`plain_tokens` K >= 1 target tokens per request,
    no draft) or "draft" (`plain_tokens` None: no plain step runs)."""

    force: str
    plain_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.force not in FORCED_STEPS:
            raise SwitchConfigError(f"force={self.force!r}: use \"plain\" (every decode step plain, plain_tokens "
                                    "target tokens per request) or \"draft\" (every decode step drafts)")
        if self.force == "draft" and self.plain_tokens is not None:
            raise SwitchConfigError(f"plain_tokens={self.plain_tokens!r} with force \"draft\": no plain step runs. "
                                    "Fix: drop plain_tokens")
        if self.force == "plain":
            object.__setattr__(self, "plain_tokens", _plain_tokens(1 if self.plain_tokens is None
                                                                   else self.plain_tokens, "forced switch"))

    @property
    def policy(self) -> str:
        return self.force

    def to_json(self) -> dict:
        return {"force": self.force} if self.plain_tokens is None else {"force": self.force,
                                                                        "plain_tokens": self.plain_tokens}


@dataclass(frozen=True)
class SwitchConfig:
    """round_table: drafting steps (batch tokens n·N); plain_table: plain steps (read at batch size n) of
    plain_tokens target tokens per request; calibration: per-position calibration of the confidence
    logits (None = raw sigmoid); prior_survival [N-1]: non-increasing, in [0, 1]; probe_share and
    max_backoff: the `BackoffRule`'s."""

    round_table: CostTable
    plain_table: CostTable
    calibration: PositionCalibration | None
    prior_survival: tuple[float, ...]
    probe_share: float = 0.02
    max_backoff: int = 1024
    plain_tokens: int = 1
    files: dict = field(default_factory=dict, compare=False)

    policy = "dynamic"

    @property
    def rule(self) -> BackoffRule:
        return BackoffRule(self.probe_share, self.max_backoff)

    @classmethod
    def load(cls, path: str | Path) -> "SwitchConfig":
        """A dynamic switch file; a forced one is an error (read either with `load_switch`)."""
        switch = load_switch(path)
        if not isinstance(switch, SwitchConfig):
            raise SwitchConfigError(f"{path}: a forced switch file ({switch.to_json()}), not the dynamic switch of "
                                    "`dspine tune-sps --plain-table`")
        return switch

    @classmethod
    def from_json(cls, data, path: Path) -> "SwitchConfig":
        """A decoded dynamic switch file; table and calibration paths are read against `path`'s folder."""
        if not isinstance(data, dict):
            raise SwitchConfigError(f"{path}: expected a JSON object with {', '.join(SWITCH_FIELDS)}")
        unknown = set(data) - set(SWITCH_FIELDS)
        missing = {"round_table", "plain_table", "prior_survival"} - set(data)
        if unknown or missing:
            raise SwitchConfigError(f"{path}: unknown field(s) {sorted(unknown)}, missing {sorted(missing)}; "
                                    f"fields are {', '.join(SWITCH_FIELDS)} (or {', '.join(FORCED_FIELDS)} for a "
                                    "forced switch)")

        def read(name: str, loader):
            file = path.parent / str(data[name])
            try:
                return loader(file)
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise SwitchConfigError(f"{path}: {name} {file}: {err}") from None

        calibration = None if data.get("calibration") is None else read("calibration", PositionCalibration.load)
        prior = data["prior_survival"]
        if (not isinstance(prior, list) or not prior or not all(isinstance(p, (int, float)) for p in prior)
                or any(not 0.0 <= p <= 1.0 for p in prior) or any(b > a for a, b in zip(prior, prior[1:]))):
            raise SwitchConfigError(f"{path}: prior_survival must be a non-empty list of numbers in [0, 1], "
                                    f"non-increasing (the tune split's observed survival per position)")
        if calibration is not None and len(calibration.temperatures) != len(prior):
            raise SwitchConfigError(f"{path}: calibration has {len(calibration.temperatures)} positions but "
                                    f"prior_survival {len(prior)}: both come from one drafter and block size")
        probe_share, max_backoff = data.get("probe_share", 0.02), data.get("max_backoff", 1024)
        plain_tokens = _plain_tokens(data.get("plain_tokens", 1), str(path))
        try:
            BackoffRule(probe_share, max_backoff)
        except ValueError as err:
            raise SwitchConfigError(f"{path}: {err}") from None
        files = {k: data[k] for k in ("round_table", "plain_table", "calibration") if k in data}
        return cls(read("round_table", load_sps_table), read("plain_table", load_sps_table), calibration,
                   tuple(float(p) for p in prior), float(probe_share), max_backoff, plain_tokens, files=files)


def switch_from_json(data, path: str | Path) -> SwitchConfig | ForcedSwitch:
    """A decoded switch file: forced iff it has `force`."""
    path = Path(path)
    if isinstance(data, dict) and "force" in data:
        unknown = sorted(set(data) - set(FORCED_FIELDS))
        if unknown:
            raise SwitchConfigError(f"{path}: unknown field(s) {unknown} in a forced switch file, which holds only "
                                    f"{', '.join(FORCED_FIELDS)}. Fix: drop them, or drop `force` for the dynamic "
                                    "switch")
        try:
            return ForcedSwitch(data["force"], data.get("plain_tokens"))
        except SwitchConfigError as err:
            raise SwitchConfigError(f"{path}: {err}") from None
    return SwitchConfig.from_json(data, path)


def load_switch(path: str | Path) -> SwitchConfig | ForcedSwitch:
    """The switch file at `path` (either kind), validated."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise SwitchConfigError(f"{path}: cannot read the switch file ({err}); fix DSPINE_DYNAMIC") from None
    except ValueError as err:
        raise SwitchConfigError(f"{path}: not JSON ({err})") from None
    return switch_from_json(data, path)


def write_switch_file(path: str | Path, *, round_table: str, plain_table: str, calibration: str | None,
                      prior_survival: Sequence[float], probe_share: float = 0.02, max_backoff: int = 1024,
                      plain_tokens: int = 1) -> None:
    """Write a dynamic switch file (paths as given: relative ones are read against `path`'s folder),
    validated first, so a bad table or calibration fails here, not in the server."""
    path = Path(path)
    payload = {"round_table": round_table, "plain_table": plain_table, "plain_tokens": plain_tokens,
               "calibration": calibration, "prior_survival": [round(float(p), 6) for p in prior_survival],
               "probe_share": probe_share, "max_backoff": max_backoff}
    SwitchConfig.from_json(payload, path)
    write_json_atomic(path, payload)


def write_forced_switch(path: str | Path, force: str, plain_tokens: int = 1) -> None:
    """Write a forced switch file: every decode step `force` ("plain": `plain_tokens` target tokens per
    request; "draft": `plain_tokens` left at 1 and not written), validated first."""
    switch = ForcedSwitch(force, None if force == "draft" and plain_tokens == 1 else plain_tokens)
    write_json_atomic(path, switch.to_json())


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
                                    f"{block_size} (SGLang reserves one block of KV slots per request and step): "
                                    f"measure the plain table with a forced plain switch file of plain_tokens <= "
                                    f"{block_size}")
        self.config, self.block_size = config, int(block_size)
        self.state = DraftOrPlain(config.rule)
        self.prior_expected = float(sum(config.prior_survival))
        self.expected: dict[str, float] = {}        # rid -> expected accepted proposals of a drafted step
        self._seconds: dict[int, tuple[float, float]] = {}

    @property
    def drafted(self) -> int:
        return self.state.drafts

    @property
    def plain(self) -> int:
        return self.state.plains

    def step_seconds(self, n: int) -> tuple[float, float]:
        """(T_round(n), T_plain(n)) from the tables, cached per batch size."""
        if n not in self._seconds:
            gamma = self.block_size - 1
            t_round = float(self.config.round_table.step_seconds(n, torch.tensor([n * gamma]))[0])
            t_plain = float(self.config.plain_table.step_seconds(n, torch.zeros(1, dtype=torch.long))[0])
            self._seconds[n] = (t_round, t_plain)
        return self._seconds[n]

    def estimate(self, rids: Sequence[str]) -> DraftEstimate:
        """A drafting step of the requests `rids` now (see the module docstring)."""
        n = len(rids)
        t_round, t_plain = self.step_seconds(n)
        expected = n + sum(self.expected.get(r, self.prior_expected) for r in rids)
        return DraftEstimate(t_round, expected, n, t_plain, self.config.plain_tokens)

    def loss(self, rids: Sequence[str]) -> tuple[float, float]:
        """(predicted loss of drafting now in seconds, T_plain(n)); loss <= 0: drafting pays."""
        estimate = self.estimate(rids)
        return estimate.loss, estimate.plain_seconds

    def decide(self, rids: Sequence[str]) -> bool:
        if not rids:
            return True
        self._forget_finished(rids)
        return self.state.decide(lambda: self.estimate(rids))

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
