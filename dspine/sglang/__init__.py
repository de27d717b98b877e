"""The SGLang adapter: the only part of DSpine that imports SGLang (tested: 0.5.17 to 0.5.23).

- `plugin`: `register`, the `sglang.srt.plugins` entry point (algorithm `DSPINE`, draft
  architecture `DSpineDraftModel`, a warning outside the tested SGLang range);
- `spec_algo`: `DSpineSpecAlgo`, SGLang's view of DSPINE (predicates, server-args resolution);
- `dspine_worker_v2`: `DSpineWorkerV2`, the DSPINE worker (a `DFlashWorkerV2`);
- `draft_model`: `DSpineDraftModel`, the SGLang draft-model class (selection from `dspine.model.selection`);
- `draft_weights`: config checks and strict weight loading for `DSpineDraftModel`;
- `compat`: the version shims between the SGLang versions;
- `plain_step`: the worker's plain decoding step (K target tokens per request, no draft);
- `mamba_pool`: what a hybrid target's recurrent-state pool allows (plain steps) and costs (verify scratch);
- `step_clock`: decode-step periods per step kind, prefills excluded (the switch's tables);
- `step_profile`: a diagnostic, where a scheduler's decode step spends host time.

The flag rules shared with `dspine serve` live in `dspine.serve.flags` (pure Python). Importing
this package imports no SGLang: each module imports it where it is needed.
"""
