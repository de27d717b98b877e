"""Triton kernels of DSpine's hot paths, each beside its PyTorch reference.

Installed as `dspine.kernels` (a top-level `kernels` package would shadow the PyPI package of
that name, which SGLang imports). `dispatch.use_triton` decides per call: Triton on CUDA, the
reference elsewhere; `DSPINE_KERNELS=torch|triton` forces either.
"""
