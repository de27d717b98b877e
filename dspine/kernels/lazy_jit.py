"""Deferred `triton.jit`: kernels are compiled-or-interpreted at their first launch, not at import.

A kernel module then imports without Triton installed (the PyTorch references stay usable), and
`TRITON_INTERPRET`, which Triton reads when a function is jitted, is honoured even when it is set
after the module was imported. Usage in a kernel module:

    _kernels = LazyJit(globals())

    @_kernels.jit
    def my_fwd_kernel(x, BLOCK: tl.constexpr): ...      # `tl` is bound in the module by build()

    def my_op(x):
        _kernels.build()
        my_fwd_kernel[grid](x, BLOCK=...)                 # module global, now a triton.jit function

Helpers shared between kernel modules live in one module with its own `LazyJit`; a module that
imports them passes it as `uses`, and its `build()` rebinds those imported names to the jitted
helpers (a kernel resolves a helper it calls through its own module's globals):

    from dspine.kernels.topk_keys import _kernels as _topk_kernels, _pack_keys
    _kernels = LazyJit(globals(), uses=(_topk_kernels,))
"""

from __future__ import annotations

import functools


class LazyJit:
    def __init__(self, module_globals: dict, uses: tuple[LazyJit, ...] = ()):
        self._globals = module_globals
        self._names: list[str] = []
        self._uses = uses

    def jit(self, fn):
        """Register `fn` to be replaced by `triton.jit(fn)` in its module at `build()`."""
        self._names.append(fn.__name__)
        return fn

    @functools.cache
    def build(self) -> None:
        import triton
        import triton.language

        self._globals["tl"] = triton.language
        for name in self._names:
            self._globals[name] = triton.jit(self._globals[name])
        for shared in self._uses:  # imported helpers: the jitted objects, never a second jit of them
            shared.build()
            for name in shared._names:
                if name in self._globals:
                    self._globals[name] = shared._globals[name]
