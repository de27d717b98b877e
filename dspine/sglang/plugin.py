"""SGLang plugin entry point: `register()` makes `--speculative-algorithm DSPINE` exist.

pyproject.toml:

    [project.entry-points."sglang.srt.plugins"]
    dspine = "dspine.sglang.plugin:register"

SGLang's `load_plugins()` calls `register()` with no arguments in every process that may parse
server args or build workers (launcher, scheduler, and in 0.5.22 also the DP controller and the
detokenizer). It registers:

- the algorithm `DSPINE` (`DSpineSpecAlgo`, overlap-capable, worker imported lazily by the factory);
- the draft architecture `DSpineDraftModel` in SGLang's `ModelRegistry`, added the moment the
  registry module is imported (at once if it already is), so processes that never load a model
  import neither the registry nor DSpine's model class;
- the target-layer capture seam on 0.5.17's text-only Qwen3.5 hybrid wrapper, added the same way when
  `sglang.srt.models.qwen3_5_text` is imported (`compat.add_text_qwen3_5_capture`);
- with `DSPINE_STEP_PROFILE=DIR` in the environment only: the decode-step profiler's wrappers on
  SGLang's `Scheduler` (`dspine.sglang.step_profile`, a diagnostic; AR servers load it too);
- with `SGLANG_RECORD_STEP_TIME=1` only: the DSPINE worker's decode-step clock in `/server_info`
  (`dspine.sglang.step_clock`);
- unless `DSPINE_VERIFY_SPLITKV=0`: a `HookRegistry` hook that puts a DSPINE server's verify and
  draft attention on DSpine's split-KV block kernel (`dspine.sglang.verify_splitkv`).

An SGLang outside the tested range (`TESTED_SGLANG`, release numbers: post-releases count as their
release) gets one warning naming both, then registration proceeds.

SGLang logs and swallows exceptions from plugins, after which the only symptom is a later
`Unknown speculative algorithm name: DSPINE`. So a failure here is logged at ERROR with the
reason and a hint, and re-raised.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import re
import sys
from typing import Callable

from dspine.sglang import compat, step_clock, step_profile, verify_splitkv
from dspine.serve.flags import ALGORITHM

logger = logging.getLogger(__name__)

DRAFT_ARCHITECTURE = "DSpineDraftModel"
TESTED_SGLANG = ("0.5.17", "0.5.23")   # first and last SGLang release the tests cover
_REGISTRY_MODULE = "sglang.srt.models.registry"
_QWEN3_5_TEXT_MODULE = "sglang.srt.models.qwen3_5_text"
_SPEC_HOOK_LOGGER = "sglang.srt.arg_groups.speculative_hook"


def register() -> None:
    """Register DSPINE with SGLang. Idempotent: a second call (or a second `load_plugins`) is a no-op."""
    try:
        warn_if_untested_sglang()
        _register_algorithm()
        _register_draft_architecture()
        _after_import(_QWEN3_5_TEXT_MODULE, compat.add_text_qwen3_5_capture)
        _hide_misleading_window_warning()
        step_profile.install_from_environment()
        step_clock.install_from_environment()
        verify_splitkv.install_from_environment()
    except Exception as e:
        logger.error(
            "DSpine could not register with SGLang: %s: %s. SGLang ignores plugin errors, so the server "
            "would fail later with 'Unknown speculative algorithm name: DSPINE'. Hint: %s",
            type(e).__name__, e, _hint())
        raise


def _hint() -> str:
    try:
        from dspine.sglang.compat import sglang_version
        version = sglang_version()
    except Exception:
        version = "not installed"
    return (f"DSpine is tested with sglang {TESTED_SGLANG[0]} to {TESTED_SGLANG[-1]} (found: {version}); "
            "run `python -c 'from dspine.sglang.plugin import register; register()'` for the full traceback, "
            "and `pip install --no-deps -e .` in the dspine checkout if the entry point is stale.")


def release_tuple(version: str) -> tuple[int, int, int] | None:
    """`0.5.23.post1` -> (0, 5, 23); None for a version string without three release numbers."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in match.groups()) if match else None


_warned_versions: set[str] = set()


def warn_if_untested_sglang(version: str | None = None) -> bool:
    """Log one warning per process and version when SGLang `version` (default: the installed one)
    lies outside `TESTED_SGLANG`. Returns True when it lies inside."""
    if version is None:
        from dspine.sglang.compat import sglang_version
        version = sglang_version()
    release = release_tuple(version)
    inside = release is not None and release_tuple(TESTED_SGLANG[0]) <= release <= release_tuple(TESTED_SGLANG[-1])
    if not inside and version not in _warned_versions:
        _warned_versions.add(version)
        logger.warning("DSpine: sglang %s is outside the tested range %s to %s; DSPINE may fail or misbehave. "
                       "Fix: install an SGLang in that range (`pip install 'dspine[sglang]'` pins one).",
                       version, TESTED_SGLANG[0], TESTED_SGLANG[-1])
    return inside


def _register_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        existing = SpeculativeAlgorithm.from_string(ALGORITHM)
    except ValueError:
        existing = None
    if existing is not None:
        if type(existing).__name__ != "DSpineSpecAlgo":
            raise RuntimeError(f"the speculative algorithm name {ALGORITHM} is already taken by "
                               f"{type(existing).__module__}.{type(existing).__name__}")
        return
    from dspine.sglang.spec_algo import DSpineSpecAlgo

    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=DSpineSpecAlgo)(_worker_factory)
    logger.info("DSpine: registered --speculative-algorithm %s.", ALGORITHM)


def _worker_factory(server_args) -> type:
    """`CustomSpecAlgo.create_worker` calls this in the scheduler; the worker (CUDA-side imports)
    is imported only then."""
    from dspine.sglang.dspine_worker_v2 import DSpineWorkerV2

    return DSpineWorkerV2


def _register_draft_architecture() -> None:
    _after_import(_REGISTRY_MODULE, _add_draft_architecture)


def _after_import(fullname: str, callback: Callable) -> None:
    """Run `callback(module)` on SGLang module `fullname` now if it is imported, else right after its
    first import (at most one pending hook per module)."""
    module = sys.modules.get(fullname)
    if module is not None:
        callback(module)
    elif not any(isinstance(f, _AfterImport) and f.fullname == fullname for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(fullname, callback))


def _add_draft_architecture(registry_module) -> None:
    try:
        from dspine.sglang.draft_model import DSpineDraftModel

        registry_module.ModelRegistry.models[DRAFT_ARCHITECTURE] = DSpineDraftModel
    except Exception as e:
        logger.error("DSpine could not register the draft architecture %s: %s: %s. Hint: %s",
                     DRAFT_ARCHITECTURE, type(e).__name__, e, _hint())
        raise


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: run `callback(module)` right after `fullname` is first imported."""

    def __init__(self, fullname: str, callback: Callable) -> None:
        self.fullname = fullname
        self.callback = callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.fullname:
            return None
        sys.meta_path.remove(self)  # let the normal finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_callback(module):
            exec_module(module)
            self.callback(module)

        spec.loader.exec_module = exec_then_callback
        return spec


class _DraftWindowWarningFilter(logging.Filter):
    """SGLang warns "--speculative-draft-window-size has no effect" for every algorithm but DFLASH and
    EAGLE*; DSPINE's DFlash-based worker does honour the window, so that warning is wrong here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("--speculative-draft-window-size has no effect")
                    and isinstance(record.args, tuple) and bool(record.args)
                    and str(record.args[0]).upper() == ALGORITHM)


def _hide_misleading_window_warning() -> None:
    hook_logger = logging.getLogger(_SPEC_HOOK_LOGGER)
    if not any(isinstance(f, _DraftWindowWarningFilter) for f in hook_logger.filters):
        hook_logger.addFilter(_DraftWindowWarningFilter())
