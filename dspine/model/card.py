"""The model card (`README.md`) written beside a saved checkpoint, with Hugging Face hub front matter.

Front matter: `base_model` (the target's hub id, when its name is one), `license`, `library_name`,
`tags`. Body: the drafter's shape from its config and, when given, the training record: data hash,
code version and budget (`CARD_FIELDS`). Local paths are never written.
"""

from __future__ import annotations

from dspine.model.config import DSpineConfig

LICENSE = "apache-2.0"
LIBRARY_NAME = "dspine"
TAGS = ("speculative-decoding", "dspine", "draft-model")
CARD_FIELDS = ("base_model", "data_hash", "code_version", "budget")


def hub_id_or_none(name: str | None) -> str | None:
    """`name` when it reads as a hub id (`owner/model`), None for local paths and bare names."""
    if not name or name.startswith(("/", ".", "~")) or name.count("/") != 1:
        return None
    return name


def model_card(name: str, cfg: DSpineConfig, *, target: dict | None = None, card: dict | None = None) -> str:
    """README.md text for checkpoint `name`. `target`: the target's identity
    (`dspine.engine.targets.target_identity`); `card`: any of `CARD_FIELDS` (`budget` a dict of
    counts such as steps and batch size, or a string). Raises ValueError naming unknown card keys."""
    card = dict(card or {})
    unknown = sorted(set(card) - set(CARD_FIELDS))
    if unknown:
        raise ValueError(f"model card fields {unknown} are unknown: use {list(CARD_FIELDS)}")
    base = card.get("base_model") or hub_id_or_none((target or {}).get("name"))
    front = ["---"] + ([f"base_model: {base}"] if base else [])
    front += [f"license: {LICENSE}", f"library_name: {LIBRARY_NAME}", "tags:"] + [f"- {tag}" for tag in TAGS] + ["---"]
    lines = front + ["", f"# {name}", "",
                     f"DSpine drafter{f' for {base}' if base else ''}: a parallel block drafter for speculative "
                     f"decoding (`dspine generate`, or SGLang with `--speculative-algorithm DSPINE`).", "",
                     "## Architecture",
                     f"- {cfg.num_hidden_layers} draft layers: hidden {cfg.hidden_size}, "
                     f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, MLP {cfg.intermediate_size}.",
                     f"- Context from target layers {cfg.target_layer_ids} of {cfg.num_target_layers}; block "
                     f"{cfg.block_size}; context window {cfg.sliding_window}.",
                     f"- Injection: {'on, top-%d, %s candidates' % (cfg.injection_top_k, cfg.injection_candidates) if cfg.injection else 'off'}; "
                     f"selection: {cfg.selection} over the top-{cfg.selection_top_k}; "
                     f"confidence head: {'yes' if cfg.confidence_head else 'no'}."]
    if target and target.get("fingerprint"):
        lines.append(f"- Target fingerprint: `{target['fingerprint']}` (checked when the drafter is loaded).")
    record = [(label, card[key]) for key, label in (("data_hash", "Data hash"), ("code_version", "Code version"),
                                                    ("budget", "Budget")) if card.get(key) not in (None, "", {})]
    if record:
        lines += ["", "## Training"]
        for label, value in record:
            if isinstance(value, dict):
                value = ", ".join(f"{k} {v}" for k, v in value.items())
            lines.append(f"- {label}: {value}")
    return "\n".join(lines) + "\n"
