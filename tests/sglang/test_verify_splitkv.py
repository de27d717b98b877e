"""`DSPINE_VERIFY_SPLITKV`: the plugin's hook on SGLang's triton backend, and SGLang's split-KV
verify kernel it turns on, against a PyTorch reference of causal verify attention (Triton's
interpreter on CPU): a prefix read through the KV pool's indices, then the 16-token block causally,
grouped-query heads of SmolLM2 and Qwen3-8B, ragged prefixes. Also the cases the kernel must leave
to SGLang's prefill kernel (non-causal drafter layers, ragged verify widths)."""

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
    yield HookRegistry
    HookRegistry._hooks[verify_splitkv.HOOK_TARGET] = before


def test_the_hooks_are_registered_once_and_only_when_asked(clean_hooks):
    def ours():
        return [h for target in (verify_splitkv.HOOK_TARGET, verify_splitkv.SCRATCH_HOOK_TARGET)
                for _, h, _ in clean_hooks._hooks.get(target, [])
                if h in (verify_splitkv.enable_split_kv_verify, verify_splitkv.zero_split_partials)]
    assert verify_splitkv.install_from_environment({}) is False and ours() == []
    assert verify_splitkv.install_from_environment({"DSPINE_VERIFY_SPLITKV": "1"}) is True
    assert verify_splitkv.install_from_environment({"DSPINE_VERIFY_SPLITKV": "1"}) is True
    assert ours() == [verify_splitkv.enable_split_kv_verify, verify_splitkv.zero_split_partials]


def test_the_hooked_constructor_exists_and_sets_what_the_hook_flips():
    """The hook's target resolves in this SGLang, and its constructor is the one that defines
    `verify_splitkv_fwd` and `use_verify_splitkv` (what `enable_split_kv_verify` reads and sets)."""
    kernel_class = pkgutil.resolve_name(verify_splitkv.SCRATCH_HOOK_TARGET.rsplit(".", 1)[0])
    assert "self.att_out = torch.empty(" in inspect.getsource(kernel_class._alloc)
    backend_class = pkgutil.resolve_name(verify_splitkv.HOOK_TARGET.rsplit(".", 1)[0])
    source = inspect.getsource(backend_class.__init__)
    assert "self.verify_splitkv_fwd =" in source and "self.use_verify_splitkv =" in source
    forward = inspect.getsource(backend_class.forward_extend)
    assert "self.use_verify_splitkv" in forward and "is_target_verify()" in forward


@pytest.mark.parametrize("algorithm, topk, has_kernel, expected", [
    ("DSPINE", 1, True, True), ("dspine", 1, True, True), ("DFLASH", 1, True, False),
    ("DSPINE", 0, True, False), ("DSPINE", 4, True, False), ("DSPINE", 1, False, False), (None, 1, True, False)])
def test_the_hook_turns_the_path_on_for_dspine_chains_only(algorithm, topk, has_kernel, expected):
    backend = SimpleNamespace(topk=topk, use_verify_splitkv=False,
                              **({"verify_splitkv_fwd": lambda *a, **k: True} if has_kernel else {}))
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_algorithm=algorithm))
    assert verify_splitkv.enable_split_kv_verify(None, backend, runner) is None      # constructor result kept
    assert backend.use_verify_splitkv is expected


def reference(q, k, v, k_buf, v_buf, kv_indptr, kv_indices, prefix):
    """Each block query i of request b attends to b's prefix (pool rows kv_indices) and block keys 0..i."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)
    for b, n_prefix in enumerate(prefix):
        idx = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        keys = torch.cat([k_buf[idx], k[b * L:(b + 1) * L]]).repeat_interleave(hq // hkv, dim=1)
        values = torch.cat([v_buf[idx], v[b * L:(b + 1) * L]]).repeat_interleave(hq // hkv, dim=1)
        for i in range(L):
            n = n_prefix + i + 1
            scores = torch.einsum("hd,nhd->hn", q[b * L + i].double(), keys[:n].double()) / d ** 0.5
            out[b * L + i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[:n].double()).to(q.dtype)
    return out


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


def split_kv(q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, scratch: str):
    """SGLang's split-KV verify, its cached scratch first allocated afresh and filled with NaN (what
    uninitialised memory may hold), then zeroed as the plugin's hook does (`scratch="hooked"`) or
    left as it is (`"as allocated"`)."""
    from sglang.kernels.ops.attention import verify_splitkv as kernel

    kernel._VK_CACHE.clear()
    bs = qo_indptr.shape[0] - 1
    vk = kernel._get_vk(bs, q.shape[1], k.shape[1], q.shape[2], v.shape[2], L, q.device,
                        n_splits=kernel.choose_n_splits(kv_indices.shape[0] / bs))
    vk.att_out.fill_(float("nan"))
    if scratch == "hooked":
        verify_splitkv.zero_split_partials(None, vk, bs)
    out = torch.zeros_like(q)
    assert kernel.verify_splitkv_fwd(q, k, v, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None, True,
                                     None, L, 1.0, 1.0) is True
    return out


@pytest.mark.parametrize("shape, prefix", [((9, 3, 64), [5, 40, 130]),     # SmolLM2: 9 query heads, 3 KV heads
                                           ((32, 8, 128), [1, 70])])       # Qwen3-8B
def test_split_kv_verify_matches_causal_verify_attention(shape, prefix):
    problem = verify_problem(prefix, *shape)
    q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices = problem
    out = split_kv(*problem, scratch="hooked")
    torch.testing.assert_close(out, reference(q, k, v, k_buf, v_buf, kv_indptr, kv_indices, prefix),
                               atol=2e-5, rtol=1e-4)


def test_unzeroed_scratch_poisons_short_prefixes():
    """Why the scratch hook exists: a 5-token prefix leaves splits without keys, and their NaN
    scratch reaches the output through a weight of 0."""
    out = split_kv(*verify_problem([5, 40, 130], 9, 3, 64), scratch="as allocated")
    assert out[:L].isnan().any()


def test_cases_it_cannot_serve_exactly_are_left_to_the_prefill_kernel():
    from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd

    q, k, v, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices = verify_problem([8, 20], 9, 3, 64)
    out = torch.zeros_like(q)
    # the drafter's layers attend both ways within the block (is_causal False)
    assert verify_splitkv_fwd(q, k, v, out, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None, False, None,
                              L, 1.0, 1.0) is False
    # a ragged verify (fewer rows than bs x width)
    assert verify_splitkv_fwd(q[:-1], k[:-1], v[:-1], out[:-1], k_buf, v_buf, qo_indptr, kv_indptr, kv_indices,
                              None, True, None, L, 1.0, 1.0) is False
    assert not out.any()
