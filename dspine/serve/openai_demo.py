"""The official `openai` client against an OpenAI-compatible server (SGLang with or without DSPINE).

Three checks, each printed as it runs:

1. a plain chat completion (greedy), sent twice: the first call only warms the server's prefix
   cache, so the compared answers both find the prompt cached (in bf16 a cached prefill can flip a
   near-tie);
2. a streamed one: tokens are printed as they arrive, and their concatenation must equal the
   non-streamed greedy answer of step 1 (same prompt, temperature 0, same max_tokens);
3. a chat completion with `tools` (one function schema): prints the tool call when the model makes
   one (name and JSON arguments, which must parse), or its text answer when it does not.

Exits 0 when all three pass, 1 with a clear message on any protocol error (HTTP error, malformed
response, stream mismatch, unparsable tool arguments). Nothing here is SGLang-specific.

    python scripts/openai_client_demo.py --base-url http://127.0.0.1:30000/v1
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPT = "What is the capital of France? Answer in one sentence."
TOOL_PROMPT = "What is the weather like in Paris right now? Use the tool if you can."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


class ProtocolError(RuntimeError):
    """The server's answer breaks the OpenAI chat-completions protocol (or this demo's checks)."""


def _message(response, what: str):
    if not response.choices:
        raise ProtocolError(f"{what}: response has no choices")
    return response.choices[0].message


def plain(client, model: str, max_tokens: int, label: str = "plain") -> str:
    """Greedy chat completion; returns the answer text."""
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=max_tokens)
    text = _message(response, "plain completion").content
    if not isinstance(text, str):
        raise ProtocolError(f"plain completion: message.content is {text!r}, expected a string")
    usage = response.usage
    print(f"[{label}] {text!r}" + (f" ({usage.completion_tokens} tokens)" if usage else ""))
    return text


def streamed(client, model: str, max_tokens: int, expected: str) -> None:
    """Stream the same greedy request; the pieces must concatenate to `expected`."""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=max_tokens,
        stream=True)
    pieces = []
    print("[stream] ", end="", flush=True)
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if choice.delta else None
            if piece:
                pieces.append(piece)
                print(piece, end="", flush=True)
    print()
    text = "".join(pieces)
    if text != expected:
        raise ProtocolError(f"streamed text differs from the non-streamed greedy answer:\n"
                            f"  streamed:     {text!r}\n  non-streamed: {expected!r}")
    print(f"[stream] {len(pieces)} chunks, identical to the non-streamed answer")


def with_tools(client, model: str, max_tokens: int) -> None:
    """Offer one function; print the call (arguments must be JSON) or the text answer."""
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": TOOL_PROMPT}], tools=[WEATHER_TOOL],
        temperature=0, max_tokens=max_tokens)
    message = _message(response, "tool completion")
    if not message.tool_calls:
        print(f"[tools] no tool call; the model answered in text: {message.content!r}")
        return
    for call in message.tool_calls:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as e:
            raise ProtocolError(f"tool call {call.function.name}: arguments are not JSON ({e}): "
                                f"{call.function.arguments!r}") from None
        print(f"[tools] tool call: {call.function.name}({json.dumps(arguments)}) id={call.id}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    p.add_argument("--model", default="default", help="the `model` field (SGLang accepts any)")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=120.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import openai
    except ImportError:
        print("the `openai` package is not installed: pip install openai", file=sys.stderr)
        return 1
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=args.timeout, max_retries=0)
    try:
        plain(client, args.model, args.max_tokens, label="plain, warm-up")
        expected = plain(client, args.model, args.max_tokens)
        streamed(client, args.model, args.max_tokens, expected)
        with_tools(client, args.model, args.max_tokens)
    except (ProtocolError, openai.OpenAIError, AttributeError, TypeError) as e:  # the last two: malformed shapes
        print(f"PROTOCOL ERROR against {args.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print("all three checks passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
