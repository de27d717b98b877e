"""The pool attributes `dspine.sglang.mamba_pool` reads, in this SGLang's `MambaPool` and
`HybridReqToTokenPool` (their constructors allocate on CUDA, so their source is checked): the
fold-every-commit flag, the ring cursors, the ring and conv-window tensors, the extra-buffer switch."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

from sglang.srt.mem_cache import memory_pool  # noqa: E402


def test_the_mamba_pool_sets_what_the_worker_reads():
    source = inspect.getsource(memory_pool.MambaPool.__init__)
    for attribute in ("self.replayssm_spec_fold =", "self.replayssm_cache_base =", "self._intermediate_conv_window_phys",
                      "self.mamba_cache = self.SpeculativeState("):
        assert attribute in source, attribute
    fields = set(getattr(memory_pool.MambaPool.SpeculativeState, "__dataclass_fields__", {})) or set(
        inspect.signature(memory_pool.MambaPool.SpeculativeState).parameters)
    assert {"temporal", "replayssm_rawv", "replayssm_rawk", "replayssm_g", "replayssm_beta"} <= fields


def test_the_hybrid_request_pool_says_whether_decode_snapshots_states():
    source = inspect.getsource(memory_pool.HybridReqToTokenPool.__init__)
    assert "self.enable_mamba_extra_buffer = enable_mamba_extra_buffer" in source
