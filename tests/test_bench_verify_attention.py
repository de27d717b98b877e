"""`scripts/bench_verify_attention.py` on CPU (--cpu-smoke: tiny shapes, the Triton interpreter,
DSpine's kernel against its PyTorch reference): the table, the results file, the refusal without CUDA."""

import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is built

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspine.bench import verify_attention as bench  # noqa: E402


def test_cpu_smoke_writes_every_case_with_its_check(tmp_path, capsys):
    assert bench.main(["--cpu-smoke", "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "verify_attention_smoke.json").read_text())
    assert {"device", "date", "command", "versions", "baseline", "runs"} <= set(results)
    cases = {(r["bs"], r["context"], r["causal"]) for r in results["runs"]}
    assert cases == {(bs, ctx, causal) for bs in (1, 2) for ctx in (0, 40) for causal in (True, False)}
    assert all(r["max_abs_diff"] < 1e-4 and r["dspine_us"] is None for r in results["runs"])
    assert "max |diff|" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_without_cuda_it_says_where_to_run_it(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device here"):
        bench.main(["--out-dir", str(tmp_path)])
