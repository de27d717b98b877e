"""dspine/bench/serving.py and dspine/serve/openai_demo.py end to end against a stub server.

The stub speaks the OpenAI chat-completions protocol (plain, SSE streaming, tools, SGLang's
`return_meta_info`/`return_token_ids`, logprobs) on 127.0.0.1 at a free port, with deterministic
outputs. Its "dspine" mode returns `spec_verify_ct` (accept length 2) and two planted divergences
from the "ar" mode: one at a near-tie of the AR logprobs (gap 0.05 nats), one not (gap 2.9).
Native `/generate` with `input_ids` (after `/flush_cache`) answers the prefill check: its one-pass
next token is the "dspine" one at the planted near-tie (forward-mode noise) and the "ar" one at the
other planted divergence (what a drafter or commit bug would look like).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import threading
import time

import pytest
from conftest import JsonHandler, start_server

from dspine.bench import parity
from dspine.bench import serving as bench
from dspine.bench.chat_client import Reply, load_prompt_mix
from dspine.bench.results import BenchError, check_schema
from dspine.serve import openai_demo as demo
from dspine.utils.http import HttpClient, HttpError

EVAL_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "sharegpt-heldout")
NEAR_TIE_PROMPT, OTHER_PROMPT = "q-gsm8k-0", "q-math500-0"  # planted divergences
NEAR_TIE_GAP, NORMAL_GAP = 0.05, 2.9


# ---------------------------------------------------------------------------------------------
# The stub server
# ---------------------------------------------------------------------------------------------

def stub_tokens(prompt: str, n: int, mode: str) -> tuple[list[int], list[list[float]]]:
    """Greedy token ids and the (AR) top-2 logprobs per position for `prompt`."""
    seed = hashlib.sha256(prompt.encode()).digest()
    ids = [100 + seed[i % len(seed)] for i in range(n)]
    top2 = [[-0.05, -0.05 - NORMAL_GAP] for _ in range(n)]
    for planted, pos, gap in ((NEAR_TIE_PROMPT, 3, NEAR_TIE_GAP), (OTHER_PROMPT, 2, NORMAL_GAP)):
        if prompt == planted and n > pos:
            top2[pos] = [-0.6, -0.6 - gap]
            if mode == "dspine":
                ids[pos] += 1  # the runner-up (near-tie) or a real error (other)
    return ids, top2


def _text(ids: list[int]) -> list[str]:
    return [f"t{i} " for i in ids]


PROMPT_END = 2  # the stub's prompt ids: the prompt's characters, then this id


def prompt_ids(prompt: str) -> list[int]:
    return [ord(ch) for ch in prompt] + [PROMPT_END]


def prefill_answer(input_ids: list[int]) -> tuple[int, list[list[float]]]:
    """The stub's one-pass next token after prompt + generated prefix, and its top-2 entries."""
    cut = input_ids.index(PROMPT_END)
    prompt, k = "".join(chr(i) for i in input_ids[:cut]), len(input_ids) - cut - 1
    ar, _ = stub_tokens(prompt, k + 1, "ar")
    spec, _ = stub_tokens(prompt, k + 1, "dspine")
    token = spec[k] if prompt == NEAR_TIE_PROMPT else ar[k]
    return token, [[-0.6, token], [-0.6 - NEAR_TIE_GAP, ar[k] if token != ar[k] else spec[k]]]


class StubHandler(JsonHandler):
    """One mode per server ("ar" or "dspine"), set on the server object."""

    def do_GET(self):
        if self.path == "/server_info":
            return self.send_json({"version": "0.5.17-stub"})
        self.send_json({"error": "not found"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/flush_cache":
            self.server.flushed = True
            return self.send_json({})
        if self.path == "/generate":
            return self._prefill(body)
        if self.path != "/v1/chat/completions":
            return self.send_json({"error": "not found"}, 404)
        mode = self.server.mode
        if mode == "ar-batch":  # plain decoding whose near-tie flips when another request is in flight
            return self._batch_sensitive(body)
        if mode == "dspine" and body.get("logprobs"):  # the benchmark asks only the AR server for them
            return self.send_json({"error": "logprobs not expected on the speculative server"}, 400)
        prompt = body["messages"][-1]["content"]
        ids, top2 = stub_tokens(prompt, body.get("max_tokens") or 16, mode)
        if body.get("tools"):
            return self.send_json(self._tool_call())
        if body.get("stream"):
            return self._stream(ids, body)
        self.send_json(self._complete(ids, top2, body, mode))

    def _batch_sensitive(self, body) -> None:
        server = self.server
        with server.lock:
            server.in_flight += 1
        time.sleep(0.05)  # long enough for a concurrent pass's requests to overlap
        with server.lock:
            batched = server.in_flight > 1
            server.in_flight -= 1
        prompt = body["messages"][-1]["content"]
        ids, top2 = stub_tokens(prompt, body.get("max_tokens") or 16, "dspine" if batched else "ar")
        if prompt == OTHER_PROMPT:  # only the near-tie flips with the batch
            ids, _ = stub_tokens(prompt, body.get("max_tokens") or 16, "ar")
        if body.get("stream"):
            return self._stream(ids, body)
        self.send_json(self._complete(ids, top2, body, "ar"))

    def _prefill(self, body) -> None:
        if not self.server.flushed:  # a prefix-cache hit would answer from decode-time KV
            return self.send_json({"error": "radix cache not flushed before this prefill"}, 400)
        self.server.flushed = False
        sp = body["sampling_params"]
        if (sp["temperature"], sp["max_new_tokens"], body["top_logprobs_num"]) != (0, 1, 2) or not body["return_logprob"]:
            return self.send_json({"error": f"unexpected prefill request {body}"}, 400)
        token, top2 = prefill_answer(body["input_ids"])
        self.send_json({"text": "", "output_ids": [token],
                        "meta_info": {"output_top_logprobs": [[[lp, t, None] for lp, t in top2]]}})

    @staticmethod
    def _tool_call() -> dict:
        call = {"id": "call_0", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}

    def _complete(self, ids, top2, body, mode) -> dict:
        pieces = _text(ids)
        choice = {"index": 0, "finish_reason": "length",
                  "message": {"role": "assistant", "content": "".join(pieces)}}
        if body.get("return_meta_info"):
            meta = {"completion_tokens": len(ids), "prompt_tokens": 5}
            if mode == "dspine":
                meta.update(spec_verify_ct=len(ids) // 2, spec_accept_length=2.0)
            choice["meta_info"] = meta
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
            choice["prompt_token_ids"] = prompt_ids(body["messages"][-1]["content"])
        if body.get("logprobs"):
            choice["logprobs"] = {"content": [
                {"token": p, "logprob": lp[0], "top_logprobs": [{"token": p, "logprob": lp[0]},
                                                                {"token": "alt", "logprob": lp[1]}]}
                for p, lp in zip(pieces, top2)]}
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "stub", "choices": [choice],
                "usage": {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids)}}

    def _stream(self, ids, body) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        pieces = _text(ids) + ([" extra"] if self.server.mode == "broken" else [])

        def chunk(choices, usage=None):
            payload = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "stub",
                       "choices": choices, **({"usage": usage} if usage else {})}
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
            self.wfile.flush()

        chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for piece in pieces:
            chunk([{"index": 0, "delta": {"content": piece}, "finish_reason": None}])
        chunk([{"index": 0, "delta": {}, "finish_reason": "length"}])
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk([], {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids)})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def stub_server():
    """Start stub servers by mode; yields `start(mode) -> base URL`; all are shut down after."""
    servers = []

    def start(mode: str) -> str:
        server = start_server(StubHandler)
        server.mode, server.lock, server.in_flight, server.flushed = mode, threading.Lock(), 0, False
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def prompts_dir(tmp_path):
    """`--prompts-dir` exports with 4 prompts per evaluation set ("q-<set>-<i>")."""
    folder = tmp_path / "prompts"
    folder.mkdir()
    for name in EVAL_SETS:
        rows = [{"id": f"{name}/{i}", "source": name, "messages": [{"role": "user", "content": f"q-{name}-{i}"}]}
                for i in range(4)]
        (folder / f"eval-{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


# ---------------------------------------------------------------------------------------------
# dspine.bench.serving
# ---------------------------------------------------------------------------------------------

def test_bench_serving_end_to_end(stub_server, prompts_dir, tmp_path):
    ar, dspine = stub_server("ar"), stub_server("dspine")
    out = tmp_path / "results"
    rc = bench.main(["--url", f"AR={ar}", "--url", f"DSPINE={dspine}", "--url", f"DSPINE-ablation={dspine}",
                     "--ablation-draft", "ablation-ckpt", "--prompts", "12", "--max-tokens", "8",
                     "--concurrency", "1,4", "--out-dir", str(out), "--prompts-dir", str(prompts_dir)])
    assert rc == 0
    results = json.loads((out / "serving_h200.json").read_text())
    check_schema(results, bench.RESULTS_SCHEMA)
    assert results["sglang"] == "0.5.17-stub"

    runs = {(r["algorithm"], r["concurrency"]): r for r in results["runs"]}
    assert set(runs) == {(a, c) for a in bench.ALGORITHMS for c in (1, 4)}
    assert all(runs[("AR", c)]["accept_len"] == 1.0 for c in (1, 4))
    assert all(runs[(a, c)]["accept_len"] == 2.0 for a in ("DSPINE", "DSPINE-ablation") for c in (1, 4))
    assert all(r["output_tok_per_s"] > 0 and r["ttft_ms"] > 0 for r in results["runs"])
    # --waves 4: the concurrency-4 level sends 16 prompts (4 full waves), more than --prompts 12
    assert [(lv["concurrency"], lv["completion_tokens"]) for lv in results["levels"]] \
        == [(1, 12 * 8), (4, 16 * 8)] * 3

    parity = results["parity"]
    assert (parity["prompts"], parity["identical"], parity["near_tie_divergences"], parity["other_divergences"]) \
        == (12, 10, 1, 1)
    by_id = {d["id"]: d for d in parity["divergences"]}
    assert by_id["gsm8k/0"]["kind"] == "near_tie" and by_id["gsm8k/0"]["position"] == 3
    assert by_id["gsm8k/0"]["gap"] == pytest.approx(NEAR_TIE_GAP)
    assert by_id["math500/0"]["kind"] == "other" and by_id["math500/0"]["position"] == 2
    assert parity["gap_histogram"] == {f"{NEAR_TIE_GAP:.3f}": 1, f"{NORMAL_GAP:.3f}": 1}

    # re-judged at a threshold below the planted near-tie: same measurement, both now "other"
    assert bench.main(["--reclassify", "--near-tie-nats", "0.01", "--out-dir", str(out)]) == 0
    again = json.loads((out / "serving_h200.json").read_text())
    assert (again["parity"]["near_tie_divergences"], again["parity"]["other_divergences"]) == (0, 2)
    assert again["parity"]["measured_near_tie_nats"] == 0.25 and again["parity"]["near_tie_nats"] == 0.01
    assert again["runs"] == results["runs"]

    c = results["ceiling"]
    assert c["accept_len"] == 2.0
    assert c["speedup"] == pytest.approx(c["accept_len"] * c["t_step_ms"] / c["t_round_ms"])
    assert c["achieved_fraction"] == pytest.approx(c["achieved_speedup"] / c["speedup"])
    assert (out / "serving_h200.png").is_file() or not importlib.util.find_spec("matplotlib")


def test_ar_control_compares_the_ar_server_with_itself_at_another_batch_size(stub_server, prompts_dir, tmp_path):
    """--ar-control 4: the AR server's near-tie flips only when requests overlap (the stub's
    "ar-batch" mode), so the serial parity pass and the concurrent control disagree there alone."""
    ar, dspine = stub_server("ar-batch"), stub_server("dspine")
    out = tmp_path / "results"
    assert bench.main(["--url", f"AR={ar}", "--url", f"DSPINE={dspine}", "--prompts", "12", "--max-tokens", "8",
                       "--concurrency", "1", "--ar-control", "4", "--out-dir", str(out),
                       "--prompts-dir", str(prompts_dir)]) == 0
    control = json.loads((out / "serving_h200.json").read_text())["parity_ar_control"]
    assert (control["prompts"], control["identical"], control["near_tie_divergences"],
            control["other_divergences"], control["concurrency"]) == (12, 11, 1, 0, 4)
    assert [(d["id"], d["position"]) for d in control["divergences"]] == [("gsm8k/0", 3)]
    assert bench.main(["--reclassify", "--near-tie-nats", "0.01", "--out-dir", str(out)]) == 0
    again = json.loads((out / "serving_h200.json").read_text())["parity_ar_control"]
    assert (again["other_divergences"], again["concurrency"]) == (1, 4)


def test_prefill_check_asks_the_ar_server_last_which_token_its_one_pass_forward_takes(stub_server, prompts_dir,
                                                                                       tmp_path):
    """--prefill-check: AR is measured after DSPINE; at the planted near-tie the stub's one-pass
    prefill takes DSPINE's token, at the planted "other" divergence the AR token (a real fault)."""
    ar, dspine = stub_server("ar"), stub_server("dspine")
    out = tmp_path / "results"
    assert bench.main(["--url", f"AR={ar}", "--url", f"DSPINE={dspine}", "--prompts", "12", "--max-tokens", "8",
                       "--concurrency", "1", "--prefill-check", "--out-dir", str(out),
                       "--prompts-dir", str(prompts_dir)]) == 0
    results = json.loads((out / "serving_h200.json").read_text())
    assert [lv["algorithm"] for lv in results["levels"]] == ["DSPINE", "AR"]
    parity = results["parity"]
    assert parity["prefill_picks"] == {"spec": 1, "ar": 1, "neither": 0}
    by_id = {d["id"]: d["prefill"] for d in parity["divergences"]}
    ar_ids = {p: stub_tokens(p, 8, "ar")[0] for p in (NEAR_TIE_PROMPT, OTHER_PROMPT)}
    spec_ids = {p: stub_tokens(p, 8, "dspine")[0] for p in (NEAR_TIE_PROMPT, OTHER_PROMPT)}
    near, other = by_id["gsm8k/0"], by_id["math500/0"]
    assert (near["picks"], near["token"], near["spec_token"], near["ar_token"]) \
        == ("spec", spec_ids[NEAR_TIE_PROMPT][3], spec_ids[NEAR_TIE_PROMPT][3], ar_ids[NEAR_TIE_PROMPT][3])
    assert (other["picks"], other["token"]) == ("ar", ar_ids[OTHER_PROMPT][2])
    assert near["top2"][0] == [-0.6, near["token"]]
    assert bench.main(["--reclassify", "--near-tie-nats", "0.01", "--out-dir", str(out)]) == 0
    again = json.loads((out / "serving_h200.json").read_text())["parity"]
    assert again["prefill_picks"] == parity["prefill_picks"] and again["other_divergences"] == 2


def test_spec_flags_go_to_the_speculative_configs_only():
    replayssm = "--enable-linear-replayssm-spec --linear-replayssm-cache-len 32"
    args = bench.parse_args(["--model-path", "/m", "--draft", "/d", "--ablation-draft", "/a",
                             "--spec-flags", replayssm])
    configs = bench.server_configs(args)
    assert configs["AR"] == ["--model-path", "/m", "--cuda-graph-max-bs-decode", "64"]
    for name, draft in (("DSPINE", "/d"), ("DSPINE-ablation", "/a")):
        assert configs[name][-5:] == ["--speculative-draft-model-path", draft, "--enable-linear-replayssm-spec",
                                      "--linear-replayssm-cache-len", "32"]
    plain = bench.server_configs(bench.parse_args(["--model-path", "/m", "--draft", "/d"]))
    assert plain["DSPINE"][-2:] == ["--speculative-draft-model-path", "/d"]  # default: nothing added
    one_flag = bench.parse_args(["--spec-flags=--enable-linear-replayssm-spec"])  # a lone flag needs the = form
    assert one_flag.spec_flags == "--enable-linear-replayssm-spec"


def test_results_name_writes_beside_the_default_results(stub_server, prompts_dir, tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "serving_h200.json").write_text("{}")  # an earlier run's results stay untouched
    rc = bench.main(["--url", f"AR={stub_server('ar')}", "--url", f"DSPINE={stub_server('dspine')}",
                     "--configs", "AR,DSPINE", "--prompts", "5", "--max-tokens", "4", "--concurrency", "1",
                     "--waves", "1", "--results-name", "serving_hybrid_h200", "--out-dir", str(out),
                     "--prompts-dir", str(prompts_dir),
                     "--spec-flags", "--enable-linear-replayssm-spec --linear-replayssm-cache-len 32"])
    assert rc == 0
    assert (out / "serving_h200.json").read_text() == "{}"
    results = json.loads((out / "serving_hybrid_h200.json").read_text())
    check_schema(results, bench.RESULTS_SCHEMA)
    assert results["settings"]["spec_flags"] == "--enable-linear-replayssm-spec --linear-replayssm-cache-len 32"
    assert "--enable-linear-replayssm-spec" in results["configs"]["DSPINE"]["flags"]
    assert "--enable-linear-replayssm-spec" not in results["configs"]["AR"]["flags"]
    assert results["parity"]["prompts"] == 5
    assert bench.main(["--reclassify", "--results-name", "serving_hybrid_h200", "--out-dir", str(out)]) == 0
    assert json.loads((out / "serving_hybrid_h200.json").read_text())["runs"] == results["runs"]
    assert (out / "serving_hybrid_h200.png").is_file() or not importlib.util.find_spec("matplotlib")


def test_ceiling_arithmetic():
    ar = [Reply(completion_tokens=100, wall_s=1.0), Reply(completion_tokens=100, wall_s=1.0)]
    spec = [Reply(completion_tokens=100, wall_s=0.5, meta_info={"spec_verify_ct": 25}),
            Reply(completion_tokens=100, wall_s=0.5, meta_info={"spec_verify_ct": 25})]
    c = parity.ceiling(ar, spec)
    assert c["t_step_ms"] == pytest.approx(10.0)  # 2 s / 200 tokens
    assert c["t_round_ms"] == pytest.approx(20.0)  # 1 s / 50 verify steps
    assert c["accept_len"] == pytest.approx(4.0)
    assert c["speedup"] == pytest.approx(2.0)  # 4 tokens per 20 ms round vs 10 ms per token
    with pytest.raises(BenchError, match="spec_verify_ct"):
        parity.ceiling(ar, ar)


def test_classify_prefix_and_missing_logprobs():
    ar = Reply(3, 0.1, token_ids=[1, 2, 3], top2=[[-0.1, -0.12]] * 3)
    assert parity.classify(ar, Reply(3, 0.1, token_ids=[1, 2, 3]), 0.1)["kind"] == "identical"
    early_stop = parity.classify(ar, Reply(2, 0.1, token_ids=[1, 2]), 0.1)  # DSPINE ended at position 2
    assert (early_stop["kind"], early_stop["position"]) == ("near_tie", 2)
    ar_short = Reply(2, 0.1, token_ids=[1, 2], top2=[[-0.1, -0.12]] * 2)
    assert parity.classify(ar_short, Reply(3, 0.1, token_ids=[1, 2, 3]), 0.1)["kind"] == "other"


def test_near_tie_threshold_is_inclusive_and_bf16_sized():
    assert bench.parse_args([]).near_tie_nats == 0.25  # two bf16 steps of a logit in [16, 32)
    assert [parity.verdict(g, 0.25) for g in (0.0, 0.125, 0.25, 0.375, None)] \
        == ["near_tie", "near_tie", "near_tie", "other", "other"]
    # fp32 logprobs: two bf16 steps measured on the H200 as 0.2500000596 (HumanEval/6); 0.2501 is not a tie.
    assert [parity.verdict(g, 0.25) for g in (0.2500000596046448, 0.2501)] == ["near_tie", "other"]


def test_schema_check_rejects_missing_and_mistyped():
    with pytest.raises(BenchError, match="missing key 'parity'"):
        check_schema({k: "x" for k in ("device", "date", "sglang", "target", "drafter", "command")}
                           | {"runs": [], "ceiling": {"t_step_ms": 1, "t_round_ms": 1, "accept_len": 1,
                                                       "speedup": 1}}, bench.RESULTS_SCHEMA)
    with pytest.raises(BenchError, match=r"runs\[0\].concurrency"):
        check_schema([{"concurrency": 1.5}], [{"concurrency": int}], "runs")


# ---------------------------------------------------------------------------------------------
# dspine.serve.openai_demo
# ---------------------------------------------------------------------------------------------

def test_openai_client_demo(stub_server, capsys):
    pytest.importorskip("openai")
    assert demo.main(["--base-url", stub_server("ar") + "/v1", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "identical to the non-streamed answer" in out
    assert 'tool call: get_weather({"city": "Paris"})' in out


def test_openai_client_demo_reports_stream_mismatch(stub_server, capsys):
    pytest.importorskip("openai")
    assert demo.main(["--base-url", stub_server("broken") + "/v1", "--max-tokens", "6"]) == 1
    assert "streamed text differs" in capsys.readouterr().err


def test_a_run_without_ar_creates_its_out_dir_and_leaves_ceiling_and_parity_null(stub_server, prompts_dir, tmp_path):
    out = tmp_path / "not" / "there" / "yet"
    rc = bench.main(["--url", f"DSPINE={stub_server('dspine')}", "--configs", "DSPINE", "--prompts", "3",
                     "--max-tokens", "4", "--concurrency", "1", "--waves", "1", "--results-name", "probe",
                     "--out-dir", str(out), "--prompts-dir", str(prompts_dir)])
    assert rc == 0
    results = json.loads((out / "probe.json").read_text())
    assert results["ceiling"] is None and results["parity"] is None
    assert [r["algorithm"] for r in results["runs"]] == ["DSPINE"]


def test_managed_servers_log_into_an_out_dir_that_did_not_exist(prompts_dir, tmp_path):
    """serve.sh writes the server log into --out-dir at start, before any result: the folder must
    exist by then (a stand-in serve script logs, then fails to start)."""
    serve = tmp_path / "serve.sh"
    serve.write_text('[ "$1" = start ] || exit 0\necho "starting with $*" > "$SGL_LOG" || exit 3\nexit 1\n')
    out = tmp_path / "new" / "results"
    rc = bench.main(["--serve-script", str(serve), "--configs", "DSPINE", "--prompts", "2", "--max-tokens", "4",
                     "--concurrency", "1", "--waves", "1", "--out-dir", str(out), "--prompts-dir", str(prompts_dir),
                     "--results-name", "probe"])
    assert rc == 1
    assert "starting with start" in (out / "sglang-DSPINE.log").read_text()
    assert "exit 1" in json.loads((out / "probe.json").read_text())["errors"][0]


def test_a_prompts_dir_without_an_export_is_named(tmp_path):
    (tmp_path / "eval-gsm8k.jsonl").write_text("")
    with pytest.raises(BenchError, match="no eval-math500.jsonl"):
        load_prompt_mix(5, tmp_path)


def test_http_client_streams_lines_and_names_a_refused_request(stub_server):
    """`HttpClient.stream_lines`: the SSE reply line by line; an HTTP error before the stream starts
    raises HttpError with the status (the benchmark's requests are not retried)."""
    url = stub_server("ar")
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True}
    lines = [line.strip() for line in HttpClient(url, retries=0).stream_lines("/v1/chat/completions", body)]
    events = [line for line in lines if line.startswith(b"data:")]
    assert events[-1] == b"data: [DONE]" and len(events) == 1 + 3 + 1 + 1  # role, 3 pieces, finish, DONE
    with pytest.raises(HttpError) as refused:
        list(HttpClient(stub_server("dspine"), retries=0).stream_lines("/v1/chat/completions",
                                                                       {**body, "logprobs": True}))
    assert refused.value.status == 400
