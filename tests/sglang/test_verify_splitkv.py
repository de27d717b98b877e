"""`DSPINE_VERIFY_SPLITKV`: the plugin's hook on SGLang's triton backend, and the split-KV block
attention it routes TARGET_VERIFY forwards to, against SGLang's own prefill kernel
(`extend_attention_fwd`, the kernel it replaces; both in Triton's interpreter on CPU): a prefix read
through the KV pool's indices, then the 16-token block causally (the target's verify) or both ways
(the drafter's block), grouped-query heads of SmolLM2 and Qwen3-8B, ragged prefixes. Also the cases
it must leave to the prefill kernel."""

import importlib.metadata
import inspect
import pkgutil
from types import SimpleNamespace

import pytest
import torch

try:
    importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("SGLang is not installed here (CPU setup: bash scripts/install_sglang_cpu.sh)",
                allow_module_level=True)

from dspine.sglang import verify_splitkv  # noqa: E402

L = 16     # verify width: anchor + 15 proposals


@pytest.fixture
def clean_hooks():
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = list(HookRegistry._hooks.get(verify_splitkv.HOOK_TARGET, []))
    # SGLang's plugin loading in an earlier test may have registered it already (it is on by default)
    HookRegistry._hooks[verify_splitkv.HOOK_TARGET] = [
        entry for entry in before if entry[1] is not verify_splitkv.enable_split_kv_verify]
    yield HookRegistry
    HookRegistry._hooks[verify_splitkv.HOOK_TARGET] = before


def test_the_hook_is_registered_once_unless_turned_off(clean_hooks):
    def ours():
        return [h for _, h, _ in clean_hooks._hooks.get(verify_splitkv.HOOK_TARGET, [])
                if h is verify_splitkv.enable_split_kv_verify]
    assert verify_splitkv.install_from_environment({"DSPINE_VERIFY_SPLITKV": "0"}) is False and ours() == []
    assert verify_splitkv.install_from_environment({}) is True                      # on by default
    assert verify_splitkv.install_from_environment({"DSPINE_VERIFY_SPLITKV": "1"}) is True
    assert ours() == [verify_splitkv.enable_split_kv_verify]


def test_the_seam_exists_in_this_sglang():
    """The hook's target resolves, its constructor defines what the hook replaces, and
    `forward_extend` calls `verify_splitkv_fwd` with the prefill kernel's arguments on TARGET_VERIFY."""
    backend_class = pkgutil.resolve_name(verify_splitkv.HOOK_TARGET.rsplit(".", 1)[0])
    source = inspect.getsource(backend_class.__init__)
    assert "self.verify_splitkv_fwd =" in source and "self.use_verify_splitkv =" in source
    forward = inspect.getsource(backend_class.forward_extend)
    assert "self.use_verify_splitkv" in forward and "is_target_verify()" in forward
    assert "self.verify_splitkv_fwd" in forward


@pytest.mark.parametrize("algorithm, topk, expected", [
    ("DSPINE", 1, True), ("dspine", 1, True), ("DFLASH", 1, False), ("DSPINE", 0, False), ("DSPINE", 4, False),
    (None, 1, False)])
def test_the_hook_routes_dspine_chains_only(algorithm, topk, expected):
    sglang_kernel = object()
    backend = SimpleNamespace(topk=topk, use_verify_splitkv=False, verify_splitkv_fwd=sglang_kernel)
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=algorithm))
    assert verify_splitkv.enable_split_kv_verify(None, backend, runner) is None      # constructor result kept
    assert backend.use_verify_splitkv is expected
    assert backend.verify_splitkv_fwd is (verify_splitkv.verify_attention_fwd if expected else sglang_kernel)


def verify_problem(prefix, hq, hkv, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = sum(prefix) + 37
    k_buf, v_buf = (torch.randn(pool, hkv, d, generator=gen) for _ in range(2))
    kv_indices = torch.randperm(pool, generator=gen)[: sum(prefix)].to(torch.int64)   # scattered KV slots
    kv_indptr = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32)
    qo_indptr = torch.arange(0, len(prefix) * L + 1, L, dtype=torch.int32)
    q = torch.randn(len(prefix) * L, hq, d, generator=gen)
    k, v = (torch.randn(len(prefix) * L, hkv, d, generator=gen) for _ in range(2))
    return q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices


def prefill_kernel():
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    return extend_attention_fwd


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape, prefix", [((9, 3, 64), [5, 0, 130]),     # SmolLM2: 9 query heads, 3 KV heads
                                           ((32, 8, 128), [1, 70])])      # Qwen3-8B
def test_block_attention_equals_sglangs_prefill_kernel(shape, prefix, causal):
    q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices = verify_problem(prefix, *shape)
    d = shape[2]
    want = torch.zeros_like(q)
    prefill_kernel()(q, k, v, want, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None, causal, None, L, 1.0, 1.0,
                     d ** -0.5)
    got = torch.full_like(q, float("nan"))
    assert verify_splitkv.verify_attention_fwd(q, k, v, got, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None,
                                               causal, None, L, 1.0, 1.0, d ** -0.5, logit_cap=0.0,
                                               sliding_window_size=-1, sinks=None, window_kv_offsets=None,
                                               xai_temperature_len=-1, max_bs=64) is True
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_cases_it_cannot_serve_exactly_are_left_to_the_prefill_kernel():
    q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices = verify_problem([8, 20], 9, 3, 64)
    out = torch.zeros_like(q)
    args = (k_buf, v_buf, qo_indptr, kv_indptr, kv_indices)
    fwd = verify_splitkv.verify_attention_fwd
    mask = torch.ones(8, dtype=torch.bool)
    assert fwd(q, k, v, out, *args, mask, True, None, L, 1.0, 1.0) is False                       # tree mask
    assert fwd(q, k, v, out, *args, None, True, None, L, 1.0, 1.0, sliding_window_size=4) is False
    assert fwd(q, k, v, out, *args, None, True, None, L, 1.0, 1.0, logit_cap=30.0) is False
    assert fwd(q, k, v, out, *args, None, True, None, L, 1.0, 1.0, sinks=torch.zeros(9)) is False
    assert fwd(q, k, v, out, *args, None, True, None, L, 0.5, 1.0) is False                        # scaled KV
    assert fwd(q, k, v, out, k_buf.half(), v_buf.half(), *args[2:], None, True, None, L, 1.0, 1.0) is False
    assert fwd(q[:-1], k[:-1], v[:-1], out[:-1], *args, None, True, None, L, 1.0, 1.0) is False   # ragged
    assert not out.any()
