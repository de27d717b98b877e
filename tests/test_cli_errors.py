"""Every bad input is a clear error before anything heavy loads (issue 25): option ranges of
`generate`, `gen-data`, `bench-accept` and `train`, the prompts file, the device, unusable
checkpoint weights in `dspine info`, and the `--compare` wording at T > 0."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import drafter_for, tiny_llama
from dspine.cli import main


@pytest.fixture()
def no_target(monkeypatch):
    """Make loading a target (or a drafter) an error: a check that runs first never gets there."""
    import dspine.engine.targets as targets

    def refuse(*args, **kwargs):
        raise AssertionError("a target was loaded before the arguments were checked")

    monkeypatch.setattr(targets, "load_target", refuse)


def _exit_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("option,value,allowed", [
    ("--max-new-tokens", "0", ">= 1"), ("--max-new-tokens", "-5", ">= 1"), ("--temperature", "-1", ">= 0"),
    ("--temperature", "nan", ">= 0"), ("--top-p", "1.5", "(0, 1]"), ("--top-p", "0", "(0, 1]"),
    ("--top-k", "-3", ">= 0"), ("--batch-size", "0", ">= 1"), ("--threads", "-1", ">= 0"),
    ("--max-new-tokens", "many", ">= 1"),
])
def test_generate_refuses_out_of_range_options(capsys, no_target, option, value, allowed):
    err = _exit_error(capsys, ["generate", option, value])
    assert f"dspine generate: error: argument {option}: " in err and allowed in err, err


@pytest.mark.parametrize("command", [["gen-data", "--out", "x.jsonl"], ["bench-accept"]])
@pytest.mark.parametrize("option,value,allowed", [("--max-new-tokens", "0", ">= 1"), ("--batch-size", "-2", ">= 1"),
                                                  ("--device", "tpu", "cpu, cuda")])
def test_gen_data_and_bench_accept_share_the_checks(capsys, no_target, command, option, value, allowed):
    err = _exit_error(capsys, [*command, option, value])
    assert f"dspine {command[0]}: error: argument {option}: " in err and allowed in err, err


@pytest.mark.parametrize("option,value", [("--top-p", "1.5"), ("--top-k", "-3"), ("--temperature", "-1")])
def test_gen_data_sampling_options_are_checked_by_argparse(capsys, option, value):
    err = _exit_error(capsys, ["gen-data", "--out", "x.jsonl", option, value])
    assert f"dspine gen-data: error: argument {option}: " in err


def test_prompts_file_is_read_before_the_target_loads(capsys, no_target, tmp_path):
    err = _exit_error(capsys, ["generate", "--prompts-file", str(tmp_path / "missing.txt")])
    assert "argument --prompts-file: " in err and "missing.txt: no such file" in err
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    err = _exit_error(capsys, ["generate", "--prompts-file", str(blank)])
    assert "blank.txt: has no non-blank line" in err


def test_an_unavailable_device_is_refused_before_the_target_loads(capsys, no_target, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["generate"], ["gen-data", "--out", "x.jsonl"], ["bench-accept"], ["train", "smollm2-dspine"]):
        err = _exit_error(capsys, [*command, "--device", "cuda"])
        assert "argument --device: 'cuda': CUDA is not available on this machine" in err and "--device cpu" in err


def _fake_run(monkeypatch, plain_tokens: list[list[int]], spec_tokens: list[list[int]]):
    """`dspine generate` with the target, drafter and engine replaced by stand-ins."""
    import dspine.cli as cli
    import dspine.engine.generate as engine
    import dspine.engine.targets as targets

    def fake_generate(target, drafter, prompts, **kw):
        tokens = spec_tokens if drafter is not None else plain_tokens
        return engine.GenerationResult(tokens=tokens, stats=engine.GenerationStats(), texts=["x"] * len(tokens))

    monkeypatch.setattr(targets, "load_target", lambda *a, **k: (None, None))
    monkeypatch.setattr(targets, "stop_token_ids", lambda *a: [2])
    monkeypatch.setattr(cli, "load_drafter_arg", lambda *a: object())
    monkeypatch.setattr(engine, "generate", fake_generate)


def test_compare_at_t_above_0_says_sampled_outputs_are_not_expected_to_match(capsys, monkeypatch):
    _fake_run(monkeypatch, plain_tokens=[[5, 6]], spec_tokens=[[5, 7]])
    argv = ["generate", "--drafter", "random", "-p", "Hi", "-q", "--compare"]
    assert main([*argv, "--temperature", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical to plain decoding" not in out
    assert "not expected to match plain decoding token by token" in out and "tests/test_sampling_exact.py" in out
    assert main([*argv, "--temperature", "0.7", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_to_plain"] is None and "distribution test" in report["comparison_note"]
    assert main([*argv, "--temperature", "0"]) == 0
    assert "[dspine] identical to plain decoding: False; speed-up" in capsys.readouterr().out


@pytest.fixture()
def sharded(tmp_path):
    """A sharded checkpoint of a tiny drafter and a directory holding its target's config."""
    from dspine.model.checkpoint import save_checkpoint

    target = tiny_llama()
    path = save_checkpoint(drafter_for(target), tmp_path / "ckpt", dtype=torch.float32, max_shard_bytes=60_000)
    target.config.save_pretrained(tmp_path / "target")
    return path, tmp_path / "target"


def test_info_checks_the_weight_files_and_exits_non_zero(sharded, capsys):
    path, target_dir = sharded
    assert main(["info", str(path), "--target", str(target_dir)]) == 0
    out = capsys.readouterr().out
    assert "weights: ok (" in out and "target: compatible" in out
    shard = sorted(path.glob("model-*-of-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert main(["info", str(path), "--target", str(target_dir)]) == 1
    out = capsys.readouterr().out
    assert f"weights: UNUSABLE — {shard}: not a readable safetensors file" in out and "re-download" in out
    assert "compatible" not in out
    shard.unlink()
    assert main(["info", str(path)]) == 1
    out = capsys.readouterr().out
    assert "weights: UNUSABLE" in out and shard.name in out and "are missing" in out


def test_info_finds_a_shape_the_config_does_not_imply(sharded, capsys):
    path, _ = sharded
    cfg = json.loads((path / "config.json").read_text())
    cfg["dspine_config"]["transfer_rank"] = 8
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(path)]) == 1
    assert "the config implies" in capsys.readouterr().out


@pytest.fixture()
def train_setup(tmp_path, monkeypatch):
    """A config-only target directory, a valid data file of 6 records, and a trainer whose target
    must never load: every error below comes from the checks that run first."""
    import dspine.train.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the checks")

    from dspine.engine.targets import target_identity

    monkeypatch.setattr(trainer, "build_training", refuse)
    config = tiny_llama().config
    config.save_pretrained(tmp_path / "target")
    record = {"ids": [1, 2, 3, 4, 5], "answer_start": 1, "target": target_identity(config, "tiny")}
    (tmp_path / "data.jsonl").write_text((json.dumps(record) + "\n") * 6)
    return tmp_path, ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.jsonl"),
                      "--run-dir", str(tmp_path / "run")]


def _train_error(capsys, argv: list[str]) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspine train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_train_errors_are_one_line_with_status_2_before_the_target_loads(train_setup, capsys):
    tmp_path, common = train_setup
    target_opt, data_opt, run_opt = common[:2], common[2:4], common[4:]
    small = ["--set", "heldout_sequences=0", "--batch-size", "2"]

    err = _train_error(capsys, ["smollm2-dspine", *target_opt, "--data", str(tmp_path / "none.jsonl"), *run_opt])
    assert "none.jsonl does not exist" in err and "dspine gen-data --out" in err
    bad = tmp_path / "bad.jsonl"
    good = (tmp_path / "data.jsonl").read_text().splitlines(keepends=True)
    bad.write_text("".join(good[:5]) + '{"ids": [1, 2, 3], "answer_start": }\n')
    err = _train_error(capsys, ["smollm2-dspine", *target_opt, "--data", str(bad), *run_opt])
    assert f"{bad}:6: not a `dspine gen-data` record" in err and "line 1 column" not in err
    (tmp_path / "c.yaml").write_text("lrr: 1\n")
    err = _train_error(capsys, [str(tmp_path / "c.yaml"), *common])
    assert "unknown key(s) ['lrr']; valid keys: data, run_dir" in err
    err = _train_error(capsys, [str(tmp_path / "no-such.yaml"), *common])
    assert "no-such.yaml' is neither a file nor a packaged config" in err
    err = _train_error(capsys, ["smollm2-dspine", *common, "--set", "lr=["])
    assert "override 'lr=[': the value is not valid YAML" in err
    err = _train_error(capsys, ["smollm2-dspine", *common])
    assert "data.jsonl holds 6 usable sequences" in err and "heldout_sequences + batch_size = 64 + 32" in err
    (tmp_path / "file").write_text("")
    err = _train_error(capsys, ["smollm2-dspine", *target_opt, *data_opt, "--run-dir", str(tmp_path / "file" / "run"),
                                *small])
    assert "is not writable" in err and "--run-dir FOLDER" in err
    assert not (tmp_path / "run").exists()


def test_train_options_are_checked_by_argparse(capsys):
    for option, value in (("--steps", "0"), ("--batch-size", "-1"), ("--time-limit-minutes", "0")):
        err = _exit_error(capsys, ["train", "smollm2-dspine", option, value])
        assert f"dspine train: error: argument {option}: " in err


def test_a_wrong_drafter_path_fails_before_the_target_loads(capsys, no_target, tmp_path):
    assert main(["generate", "--drafter", str(tmp_path / "no-such-drafter")]) == 2
    assert "no-such-drafter' is neither a local directory nor a reachable hub repo" in capsys.readouterr().err
