"""`dspine gen-data`: the transformers path and the SGLang-server path give the same records.

The server is a stub speaking SGLang's native `/generate` (batched `input_ids`, `output_ids`,
`meta_info.finish_reason`) whose answers come from the real SmolLM2 target, one prompt at a time,
with the stop token left out of `output_ids` as SGLang may do; the records must still equal the
transformers path's, stop tokens included.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import JsonHandler, start_server

from dspine.data.prompts import Prompt, save_prompts
from dspine.engine.targets import load_target, stop_token_ids
from dspine.train import gen_data
from dspine.train.cli import cmd_gen_data

pytestmark = pytest.mark.slow

PROMPTS = [Prompt("t/0", [{"role": "user", "content": "Say hello."}], "test"),
           Prompt("t/1", [{"role": "user", "content": "What is 2 + 3? Answer with a number only."}], "test"),
           Prompt("t/2", [{"role": "user", "content": "Name a colour."}], "test")]
MAX_NEW = 12


@pytest.fixture(scope="module")
def smollm2():
    target, tokenizer = load_target()
    return target, tokenizer, stop_token_ids(tokenizer, target)


@pytest.fixture
def sglang_stub(smollm2):
    """A stub of SGLang's `/generate`: greedy answers of the real target, stop token stripped."""
    target, _, stops = smollm2
    seen: list[dict] = []

    class Handler(JsonHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            params = body["sampling_params"]
            replies = []
            for ids in body["input_ids"]:
                with torch.no_grad():
                    out = target.generate(input_ids=torch.tensor([ids]), max_new_tokens=params["max_new_tokens"],
                                          do_sample=False, eos_token_id=params["stop_token_ids"],
                                          pad_token_id=stops[0])
                answer = out[0, len(ids):].tolist()
                if answer and answer[-1] in params["stop_token_ids"]:
                    finish = {"type": "stop", "matched": answer.pop()}
                else:
                    finish = {"type": "length", "length": len(answer)}
                replies.append({"text": "", "output_ids": answer, "meta_info": {"finish_reason": finish}})
            self.send_json(replies)

    server = start_server(Handler)
    url = server.url
    yield url, seen
    server.shutdown()


def test_server_path_equals_transformers_path(smollm2, sglang_stub):
    target, tokenizer, stops = smollm2
    url, seen = sglang_stub
    common = dict(max_prompt_tokens=384, max_new_tokens=MAX_NEW, batch_size=2, temperature=0.0, seed=0,
                  progress=False)
    local = list(gen_data.generate_answers(target, tokenizer, PROMPTS, **common))
    served = list(gen_data.generate_answers_server(url, tokenizer, stops, PROMPTS, concurrency=2, **common))
    assert served == sorted(local, key=lambda r: [p.id for p in PROMPTS].index(r["id"]))
    assert sorted(len(b["input_ids"]) for b in seen) == [1, 2]  # batches of --batch-size prompts, 2 in flight
    assert any(r["ids"][-1] in stops for r in served), "no answer ended on a stop token: the test lost its point"


def test_server_answers_cut_and_complete_stop_tokens():
    replies = [{"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}},
               {"output_ids": [5, 2, 7], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}},
               {"output_ids": [8, 9], "meta_info": {"finish_reason": {"type": "length", "length": 2}}},
               {"output_ids": [8], "meta_info": {"finish_reason": {"type": "stop", "matched": "</s>"}}}]

    class Handler(JsonHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_json(replies)

    server = start_server(Handler)
    url = server.url
    try:
        got = gen_data.server_answers(url, [[1]] * 4, [2], max_new_tokens=4, temperature=0.0, seed=0)
    finally:
        server.shutdown()
    assert got == [[5, 6, 2], [5, 2], [8, 9], [8]]


def test_errors_name_the_cause(tmp_path, monkeypatch, capsys):
    with pytest.raises(gen_data.GenDataError, match="no SGLang server answers at .*drop --server"):
        gen_data.server_answers("http://127.0.0.1:9", [[1]], [2], max_new_tokens=1, temperature=0.0, seed=0)

    save_prompts(tmp_path / "train.jsonl", PROMPTS)
    args = type("Args", (), dict(samples_per_prompt=3, temperature=0.0, num_prompts=None, seed=0, server=None,
                                 out=str(tmp_path / "d.jsonl"), prompts_dir=str(tmp_path)))()
    assert cmd_gen_data(args) == 2
    assert "--samples-per-prompt > 1 with greedy decoding" in capsys.readouterr().err
    args.samples_per_prompt, args.top_p, args.top_k = 1, 0.95, 0
    assert cmd_gen_data(args) == 2
    assert "--top-p/--top-k shape sampled answers" in capsys.readouterr().err
    args.temperature, args.top_p = 1.0, 1.5
    assert cmd_gen_data(args) == 2
    assert "--top-p must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "d.jsonl").exists()


def test_samples_per_prompt_ids():
    repeated = gen_data._repeat_for_samples(PROMPTS[:2], 3, sampled=True)
    assert [p.id for p in repeated] == ["t/0#0", "t/0#1", "t/0#2", "t/1#0", "t/1#1", "t/1#2"]
    assert repeated[4].messages == PROMPTS[1].messages
    # one sampled answer per prompt still gets '#0': it joins a greedy file without clashing ids
    assert [p.id for p in gen_data._repeat_for_samples(PROMPTS[:2], 1, sampled=True)] == ["t/0#0", "t/1#0"]
    assert [p.id for p in gen_data._repeat_for_samples(PROMPTS[:2], 1, sampled=False)] == ["t/0", "t/1"]


def test_top_k_one_sampling_is_greedy(smollm2):
    """T=1 with top-k 1 keeps only the argmax: the sampled answers must equal the greedy ones. Without
    an explicit top_k, transformers would sample from its generation config's top-k 50 instead."""
    target, tokenizer, _ = smollm2
    common = dict(max_prompt_tokens=384, max_new_tokens=MAX_NEW, batch_size=3, seed=0, progress=False)
    greedy = list(gen_data.generate_answers(target, tokenizer, PROMPTS, temperature=0.0, **common))
    top1 = list(gen_data.generate_answers(target, tokenizer, PROMPTS, temperature=1.0, top_k=1, **common))
    assert top1 == greedy
    wide = list(gen_data.generate_answers(target, tokenizer, PROMPTS, temperature=5.0, **common))
    assert wide != greedy, "T=5 sampling matched greedy on every prompt: the test lost its point"


def test_server_gets_the_sampling_settings():
    seen: list[dict] = []

    class Handler(JsonHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_json([{"output_ids": [4], "meta_info": {}}])

    server = start_server(Handler)
    try:
        gen_data.server_answers(server.url, [[1]], [2], max_new_tokens=4, temperature=1.0, seed=7, top_p=0.95,
                                top_k=20)
        gen_data.server_answers(server.url, [[1]], [2], max_new_tokens=4, temperature=0.8, seed=7)
        gen_data.server_answers(server.url, [[1]], [2], max_new_tokens=4, temperature=0.0, seed=7, top_p=0.5)
    finally:
        server.shutdown()
    params = [b["sampling_params"] for b in seen]
    assert (params[0]["temperature"], params[0]["top_p"], params[0]["top_k"], params[0]["sampling_seed"]) == \
        (1.0, 0.95, 20, 7)
    assert (params[1]["top_p"], params[1]["top_k"]) == (1.0, -1)    # off, in SGLang's terms
    assert "top_p" not in params[2] and "sampling_seed" not in params[2]   # greedy: no sampling settings


def test_records_carry_their_targets_identity(smollm2, sglang_stub, tmp_path):
    from dspine.engine.targets import target_identity

    target, _, _ = smollm2
    url, _ = sglang_stub
    save_prompts(tmp_path / "train.jsonl", PROMPTS)
    args = type("Args", (), dict(samples_per_prompt=1, temperature=0.0, top_p=1.0, top_k=0, num_prompts=None, seed=0,
                                 server=url, target=None, max_prompt_tokens=384, max_new_tokens=4, batch_size=2,
                                 concurrency=1, quiet=True, device=None, out=str(tmp_path / "d.jsonl"),
                                 prompts_dir=str(tmp_path), data_dir=None))()
    assert cmd_gen_data(args) == 0
    records = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    identity = target_identity(target.config, "smollm2-135m-instruct")
    assert [r["id"] for r in records] == [p.id for p in PROMPTS]
    assert all(r["target"] == {"name": "smollm2-135m-instruct", "fingerprint": identity["fingerprint"]}
               for r in records)
