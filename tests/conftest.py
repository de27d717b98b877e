"""Shared fixtures: tiny random transformers targets and drafters built for them."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# CPU runs execute Triton kernels in the interpreter. The mode is fixed when a kernel is created, so
# it must be set before any test module imports dspine or triton; GPU runs set TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dspine import DSpineConfig, DSpineDrafter  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))



class JsonHandler(BaseHTTPRequestHandler):
    """A quiet stub-server request handler with `send_json`; tests subclass it with do_GET/do_POST."""

    def log_message(self, *args):  # keep pytest output quiet
        pass

    def send_json(self, payload, code: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class StubServer(ThreadingHTTPServer):
    """A threading HTTP server whose listen backlog holds a benchmark's whole burst of connections
    (the default 5 resets some of 16 concurrent clients on a busy machine)."""

    request_queue_size = 128


def start_server(handler_cls) -> ThreadingHTTPServer:
    """Serve `handler_cls` on a free localhost port from a daemon thread; its base URL is `.url`.
    The caller shuts it down (`shutdown()`, `server_close()`)."""
    server = StubServer(("127.0.0.1", 0), handler_cls)
    server.daemon_threads = True
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def tiny_llama(vocab: int = 256, hidden: int = 64, layers: int = 6, seed: int = 0, init: float = 0.2):
    """A random Llama target whose logits are spread enough that greedy near-ties are rare."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=init, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval().requires_grad_(False)


def tiny_qwen3(vocab: int = 256, hidden: int = 64, layers: int = 6, seed: int = 1):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def drafter_for(target, seed: int = 0, **overrides) -> DSpineDrafter:
    """A random DSpine drafter shaped for `target`, attached to it."""
    torch.manual_seed(seed)
    # per_layer: the tests' drafters keep the injection they were written for (the shipped default is first_layer)
    opts = dict(transfer_rank=16, sliding_window=64, injection_top_k=4, selection_top_k=4, successor_table_size=8,
                mask_token_id=3, injection_candidates="per_layer")
    opts.update(overrides)
    cfg = DSpineConfig.for_target(target.config, **opts)
    model = DSpineDrafter(cfg).eval()
    model.attach_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return model


def tiny_qwen2(vocab: int = 256, hidden: int = 64, layers: int = 6, seed: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval().requires_grad_(False)


def tiny_qwen3_next():
    """4 layers (GDN, attention, GDN, attention), fp32. initializer_range 0.05: fp32 noise between
    transformers' own prefill and decode paths stays ~2e-6, while replaying one token too few moves
    logits by ~1e-3 (0.02, the default, leaves the GDN state nearly invisible in the logits)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2,
        num_experts=0, initializer_range=0.05, max_position_embeddings=256, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(cfg).eval()



@pytest.fixture(scope="session")
def llama_target():
    return tiny_llama()


@pytest.fixture(scope="session")
def qwen3_target():
    return tiny_qwen3()


def fixed_prompts(n: int, vocab: int, seed: int = 123) -> list[list[int]]:
    """n prompts of lengths 3..(3+n) with tokens in [4, vocab)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (3 + (i * 7) % 23,), generator=g).tolist() for i in range(n)]
