"""The SGLang adapter: the only part of DSpine that imports SGLang (supported: 0.5.17 to 0.5.22).

- `plugin.register`: the `sglang.srt.plugins` entry point (algorithm `DSPINE`, draft architecture
  `DSpineDraftModel`);
- `algorithm.DSpineSpecAlgo`: SGLang's view of DSPINE (predicates, server-args resolution);
- `rules`: the flag rules, pure Python, shared with `dspine serve`;
- `compat`: the version shims between SGLang 0.5.17 and 0.5.22;
- `worker`, `draft_model`: the DSPINE worker and SGLang draft-model class;
- `plain_step`: the worker's plain decoding step (K target tokens per request, no draft);
- `step_clock`: decode-step periods per step kind, prefills excluded (the switch's tables);
- `step_profile`: a diagnostic, where a scheduler's decode step spends host time.

Importing this package imports no SGLang: each module imports it where it is needed.
"""
