"""dspine/bench/served_sampling.py against two stub servers: the same sampler passes, a sampler
that is off at one position fails there and only there."""

from __future__ import annotations

import json
import random
import threading
from collections import Counter

import pytest
from conftest import JsonHandler, start_server

from dspine.bench import served_sampling as check

TOKENS = [11, 12, 13, 14, 15, 16]
WEIGHTS = [0.35, 0.25, 0.15, 0.1, 0.1, 0.05]


def serve(seed: int, skew_position: int | None = None, verify_rounds_per_token: float = 0.5, algorithm=None):
    """A /generate stub drawing each output position i.i.d. from WEIGHTS; at `skew_position`
    (0-based) the first two tokens' weights are swapped."""
    rng, lock = random.Random(seed), threading.Lock()

    class Handler(JsonHandler):
        def do_GET(self):
            if self.path != "/server_info":
                return self.send_json({}, code=404)
            self.send_json({"version": "0.0.stub", "speculative_algorithm": algorithm, "model_path": "/m"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = body["sampling_params"]["max_new_tokens"]
            with lock:
                ids = []
                for j in range(n):
                    w = list(WEIGHTS)
                    if j == skew_position:
                        w[0], w[1] = w[1], w[0]
                    ids.append(rng.choices(TOKENS, w)[0])
            reply = {"text": "", "output_ids": ids,
                     "meta_info": {"completion_tokens": n, "spec_verify_ct": int(n * verify_rounds_per_token)}}
            self.send_json(reply)

    server = start_server(Handler)
    return server, server.url


@pytest.fixture
def servers():
    started = []

    def start(*args, **kwargs):
        server, url = serve(*args, **kwargs)
        started.append(server)
        return url

    yield start
    for s in started:
        s.shutdown()


def test_the_same_sampler_is_indistinguishable(servers, tmp_path):
    out = tmp_path / "check.json"
    rc = check.main(["--url-a", servers(1), "--url-b", servers(2, algorithm="DSPINE"), "--samples", "1500",
                     "--max-new-tokens", "4", "--concurrency", "8", "--out", str(out), "--device", "stub GPU"])
    result = json.loads(out.read_text())
    assert rc == 0 and result["verdict"] == "indistinguishable"
    assert result["device"] == "stub GPU"
    assert result["servers"]["a"]["speculative_algorithm"] is None
    assert result["servers"]["b"] == {"version": "0.0.stub", "speculative_algorithm": "DSPINE", "model_path": "/m",
                                      "speculative_draft_model_path": None, "speculative_num_draft_tokens": None}
    assert [r["position"] for r in result["positions"]] == [1, 2, 3, 4]
    assert result["accept_len"]["b"] == 2.0  # 4 tokens in 2 verify rounds


def test_a_sampler_off_at_one_position_fails_there(servers, tmp_path):
    out = tmp_path / "check.json"
    rc = check.main(["--url-a", servers(1), "--url-b", servers(2, skew_position=1), "--samples", "1500",
                     "--max-new-tokens", "3", "--concurrency", "8", "--out", str(out)])
    pvalues = [r["pvalue"] for r in json.loads(out.read_text())["positions"]]
    assert rc == 1
    assert pvalues[1] < 1e-6 and pvalues[0] > 0.001 and pvalues[2] > 0.001


def test_rare_ids_pool_into_one_cell_and_identical_samples_give_p_one():
    a = Counter({1: 500, 2: 480, 3: 2, 4: 1})
    p, cells = check.homogeneity_pvalue(a, Counter(a), min_expected=5.0)
    assert cells == 3 and p == pytest.approx(1.0)
    assert check.homogeneity_pvalue(Counter({7: 10}), Counter({7: 12}), 5.0) == (1.0, 1)


def test_greedy_is_refused(capsys):
    with pytest.raises(SystemExit):
        check.main(["--url-a", "http://x", "--url-b", "http://y", "--temperature", "0"])
    assert "bench_serving" in capsys.readouterr().err
