"""Registration of DSPINE with a real SGLang (CPU): entry point, algorithm, draft architecture.

Runs inside `.venv-sglang` (bash scripts/install_sglang_cpu.sh); skips where SGLang is absent.
"""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

# Installed or not is read from package metadata: an import would be fooled by `tests/sglang/`, which
# looks like a namespace package called `sglang`. An installed but broken SGLang fails loudly.
try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.speculative import spec_registry  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from dspine.sglang import plugin  # noqa: E402


@pytest.fixture(scope="module")
def algo():
    load_plugins()
    return SpeculativeAlgorithm.from_string("dspine")


def test_entry_point_is_installed():
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "dspine"]
    assert [ep.value for ep in eps] == ["dspine.sglang.plugin:register"], \
        "install dspine into this venv: pip install --no-deps -e ."


def test_load_plugins_registers_dspine(algo):
    assert type(algo).__name__ == "DSpineSpecAlgo"
    assert algo.name == "DSPINE" and algo.supports_overlap
    assert SpeculativeAlgorithm.from_string("DSPINE") is algo
    assert spec_registry.get_spec("dspine") is algo
    with pytest.raises(ValueError, match="Unknown speculative algorithm name"):
        SpeculativeAlgorithm.from_string("dspine2")


def test_register_is_idempotent(algo):
    plugin.register()
    plugin.register()
    assert SpeculativeAlgorithm.from_string("dspine") is algo
    pending = [f.fullname for f in sys.meta_path if isinstance(f, plugin._AfterImport)]
    assert len(pending) == len(set(pending))      # at most one hook waits per module
    hook_logger = logging.getLogger(plugin._SPEC_HOOK_LOGGER)
    assert sum(isinstance(f, plugin._DraftWindowWarningFilter) for f in hook_logger.filters) == 1


def test_conforms_to_every_enum_predicate(algo):
    interface = {n for n in vars(SpeculativeAlgorithm) if n.startswith(("is_", "supports_"))}
    assert interface <= set(dir(algo))


def test_dflash_family_predicates(algo):
    assert algo.is_dflash_family() and algo.supports_target_verify_for_draft()
    assert algo.is_speculative() and algo.is_some() and not algo.is_none()
    assert not (algo.is_dflash() or algo.is_dspark() or algo.is_eagle() or algo.is_eagle3() or algo.is_ngram()
                or algo.is_standalone() or algo.is_frozen_kv_mtp())
    assert algo.supports_grammar_overlap() and algo.supports_mixed_chunk()
    assert not algo.supports_ragged_verify()
    assert algo.has_draft_kv()
    assert algo.get_num_tokens_per_req_for_target_verify(16, True) == 16


def test_the_three_methods_custom_spec_algo_lacks(algo):
    base = spec_registry.CustomSpecAlgo
    for name in ("carries_draft_hidden_states", "create_future_map", "need_topk"):
        assert not hasattr(base, name), f"SGLang now defines CustomSpecAlgo.{name}: revisit DSpineSpecAlgo"
        assert callable(getattr(algo, name))
    assert algo.carries_draft_hidden_states() is False
    assert algo.need_topk() is False
    pool = SimpleNamespace(req_to_token=torch.zeros(4, 8, dtype=torch.int32), size=4)
    future_map = algo.create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
    assert type(future_map).__name__ == "FutureMap"
    assert future_map.spec_algo is algo


def test_build_disagg_draft_input_takes_any_signature(algo, monkeypatch):
    try:
        from sglang.srt.speculative import dflash_disaggregation  # 0.5.18+
    except ImportError:  # 0.5.17: (batch, server_args, last_tokens, future_map), no DFlash builder
        assert algo.build_disagg_draft_input("batch", "server_args", "last_tokens", "future_map") is None
        return
    seen = []
    monkeypatch.setattr(dflash_disaggregation, "build_dflash_disagg_draft_input", lambda *a: seen.append(a) or "input")
    assert algo.build_disagg_draft_input("batch", "last_tokens", "future_map") == "input"
    assert seen == [("batch", "last_tokens", "future_map")]


def test_worker_factory_imports_the_worker_lazily(algo):
    server_args = SimpleNamespace(disable_overlap_schedule=False)
    worker_cls = algo.create_worker(server_args)
    assert worker_cls.__module__ == "dspine.sglang.dspine_worker_v2" and worker_cls.__name__ == "DSpineWorkerV2"


def test_model_registry_resolves_the_draft_architecture(algo):
    from sglang.srt.models.registry import ModelRegistry

    cls, arch = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
    assert arch == "DSpineDraftModel"
    assert (cls.__module__, cls.__name__) == ("dspine.sglang.draft_model", "DSpineDraftModel")


def test_draft_architecture_is_registered_lazily():
    """After load_plugins, neither SGLang's model registry nor DSpine's model class is imported;
    importing the registry later finds the architecture there."""
    code = textwrap.dedent("""
        import sys
        from sglang.srt.plugins import load_plugins
        load_plugins()
        assert "sglang.srt.models.registry" not in sys.modules
        assert "dspine.sglang.draft_model" not in sys.modules
        from sglang.srt.models.registry import ModelRegistry
        cls, arch = ModelRegistry.resolve_model_cls(["DSpineDraftModel"])
        assert cls.__module__ == "dspine.sglang.draft_model", cls
        print("LAZY-OK")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "LAZY-OK" in done.stdout, done.stderr[-3000:]


def test_registration_failure_is_logged_loudly_and_reraised(algo, monkeypatch, caplog):
    monkeypatch.setattr(spec_registry, "_REGISTRY", {})  # as if DSPINE were not registered yet

    def broken(spec_class):
        raise TypeError("DSpineSpecAlgo is missing duck-typed methods from SpeculativeAlgorithm: ['is_new']")

    monkeypatch.setattr(spec_registry, "_assert_custom_spec_algo_conforms", broken)
    with caplog.at_level(logging.ERROR, logger=plugin.__name__), pytest.raises(TypeError, match="is_new"):
        plugin.register()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = record.getMessage()
    assert "DSpine could not register with SGLang: TypeError" in message
    assert "Unknown speculative algorithm name: DSPINE" in message and "Hint:" in message
    assert "0.5.17 to 0.5.23" in message


def test_a_foreign_dspine_registration_is_refused(algo, monkeypatch, caplog):
    monkeypatch.setattr(spec_registry, "_REGISTRY", {"DSPINE": spec_registry.CustomSpecAlgo("DSPINE", None)})
    with caplog.at_level(logging.ERROR, logger=plugin.__name__), pytest.raises(RuntimeError, match="already taken"):
        plugin.register()
    assert any("DSpine could not register" in r.getMessage() for r in caplog.records)


def test_sglang_swallows_plugin_errors_so_ours_must_be_loud():
    """The reason `register()` logs at ERROR: SGLang's loader only logs and continues."""
    import inspect

    from sglang.srt import plugins

    assert "Failed to execute general plugin" in inspect.getsource(plugins.load_plugins)


def test_misleading_window_warning_is_hidden_for_dspine_only(algo):
    hook_filter = plugin._DraftWindowWarningFilter()

    def record(algorithm):
        return logging.LogRecord(plugin._SPEC_HOOK_LOGGER, logging.WARNING, __file__, 1,
                                 "--speculative-draft-window-size has no effect with speculative_algorithm=%s "
                                 "(honored by ...).", (algorithm,), None)

    assert not hook_filter.filter(record("DSPINE"))
    assert hook_filter.filter(record("NGRAM"))


def test_untested_sglang_version_warns_once_naming_version_and_range(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_warned_versions", set())
    caplog.set_level(logging.WARNING, logger=plugin.__name__)
    for version in ("0.5.17", "0.5.20", "0.5.23", "0.5.23.post1"):
        assert plugin.warn_if_untested_sglang(version)
    assert not caplog.records
    assert not plugin.warn_if_untested_sglang("0.5.24")
    assert not plugin.warn_if_untested_sglang("0.5.24")       # a second time: no second line
    assert not plugin.warn_if_untested_sglang("0.5.16")
    assert not plugin.warn_if_untested_sglang("nightly")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("0.5.17 to 0.5.23" in line for line in lines)
    assert "sglang 0.5.24 is outside" in lines[0] and "sglang 0.5.16 is outside" in lines[1]


def test_register_checks_the_installed_version(algo, monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_warned_versions", set())
    monkeypatch.setattr("dspine.sglang.compat.sglang_version", lambda: "0.6.0")
    caplog.set_level(logging.WARNING, logger=plugin.__name__)
    plugin.register()
    plugin.register()
    assert [r.getMessage() for r in caplog.records if "outside the tested range" in r.getMessage()] == [
        "DSpine: sglang 0.6.0 is outside the tested range 0.5.17 to 0.5.23; DSPINE may fail or misbehave. "
        "Fix: install an SGLang in that range (`pip install 'dspine[sglang]'` pins one)."]
    assert plugin.warn_if_untested_sglang(importlib.metadata.version("sglang"))   # the installed one is tested
