"""`scripts/bench_kernels.py --only suffix_match|cross_entropy` on CPU (--cpu-smoke: tiny shapes, the
Triton interpreter): one kernel alone, timed and checked against its reference at every shape (and
batch size, or number of loss levels), nothing else measured; the result files' device names."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is built

import pytest  # noqa: E402

pytest.importorskip("triton")

from dspine.bench import kernels as bench  # noqa: E402


def test_only_suffix_match_times_that_kernel_alone(tmp_path):
    assert bench.main(["--cpu-smoke", "--only", "suffix_match", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "kernels_cpu.json").read_text())
    details = json.loads((tmp_path / "kernels_cpu_details.json").read_text())
    cases = {(c["name"], c["shape"], c["bs"]) for c in results["cases"]}
    assert cases == {("suffix_match", shape, bs) for shape in ("tiny-a", "tiny-b") for bs in (1, 2)}
    assert all(c["triton_ms"] > 0 and c["eager_ms"] > 0 for c in results["cases"])
    assert results["round"] == [] and results["verify"] == []
    checks = [c for c in details["correctness"] if c["kernel"] == "suffix_match"]
    assert len(checks) == 4 and all(c["ok"] for c in checks)
    assert "--only suffix_match" in results["command"]


def test_only_cross_entropy_times_the_loss_chunk_alone(tmp_path):
    assert bench.main(["--cpu-smoke", "--only", "cross_entropy", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "kernels_cpu.json").read_text())
    details = json.loads((tmp_path / "kernels_cpu_details.json").read_text())
    cases = {(c["name"], c["shape"], c["bs"]) for c in results["cases"]}
    assert cases == {(f"cross_entropy_p{p}", shape, 8) for shape in ("tiny-a", "tiny-b") for p in (1, 2)}
    assert all(c["triton_ms"] > 0 and c["eager_ms"] > 0 for c in results["cases"])
    checks = [c for c in details["correctness"] if c["kernel"].startswith("cross_entropy")]
    assert len(checks) == 4 and all(c["ok"] for c in checks)


@pytest.mark.parametrize("name, slug", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                        ("NVIDIA A100-SXM4-80GB", "a100"), ("cpu (Triton interpreter smoke run)", "cpu"),
                                        ("NVIDIA GeForce RTX 4090", "nvidia-geforce-rtx-4090")])
def test_result_files_are_named_after_the_device_measured(name, slug):
    from dspine.bench.results import device_slug
    assert device_slug(name) == slug
