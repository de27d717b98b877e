"""`SlotTokenHistory`: every running request's token ids on the GPU, for copy candidates.

SGLang keeps a request's token ids on the host (`origin_input_ids`, `output_ids`), updated after
each step's result is processed, a step late under overlap scheduling. The copy candidates need
them on the device inside the draft CUDA graph, so the worker keeps its own table, indexed like
SGLang's `req_to_token` by `req_pool_idx`:

    ids[slot, p] = the token at position p of the request in `slot`   [pool rows, context + B + 1]

Writes (all on the forward stream, so the next step's draft reads them in order; no host sync):
- `write_prefill(batch, next_token_ids)`: the last `window` prompt tokens (one host-to-device copy
  per prefill batch) and the first sampled token, the next round's anchor, at position len(prompt);
- `write_committed(req_pool_indices, prefix_lens, tokens [bs, W], commit_lens [bs])`: after a
  verify (or plain) step, `tokens[b, :commit_lens[b]]` at positions prefix_lens[b] + 1 ...; the
  positions past the commit get the rest of the row, which is never read (reads stop at the
  length) and overwritten by the next commit.
Reads: `prepare_draft(req_pool_indices, prefix_lens)` fills the static `rows`/`lengths` buffers
the captured draft graph reads (a request's history is positions 0..prefix_len, the anchor
included); `window_rows(n)` gathers the last `window` tokens of the first n rows, left-aligned.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SlotTokenHistory:
    """Per-request token ids on the device (see the module docstring).

    pool_rows: SGLang's req_to_token rows (slot 0 is its padding row); max_context_len: the
    longest sequence; block_size: the widest commit; window: how many recent tokens the copy
    candidates look at; max_bs: the largest draft batch (graph batch sizes included)."""

    def __init__(self, *, pool_rows: int, max_context_len: int, block_size: int, window: int, max_bs: int,
                 device) -> None:
        self.capacity = int(max_context_len) + int(block_size) + 1   # the last column takes overflow writes
        self.window = int(window)
        self.ids = torch.zeros((int(pool_rows), self.capacity), dtype=torch.int32, device=device)
        self.rows = torch.zeros((int(max_bs),), dtype=torch.int64, device=device)
        self.lengths = torch.zeros((int(max_bs),), dtype=torch.int64, device=device)
        self._offsets = torch.arange(self.window, dtype=torch.int64, device=device)

    def write_prefill(self, req_pool_indices: Tensor, fill_ids: list, next_token_ids: Tensor) -> None:
        """Prefill of bs requests: fill_ids[b] the request's tokens so far (prompt, plus output
        after a retraction), next_token_ids [bs] the token sampled after them (the anchor)."""
        device = self.ids.device
        rows, positions, tokens = [], [], []
        for b, ids in enumerate(fill_ids):
            start = max(0, len(ids) - self.window)
            rows.extend([b] * (len(ids) - start))
            positions.extend(range(start, len(ids)))
            tokens.extend(ids[start:])
        slots = req_pool_indices.to(device=device, dtype=torch.int64)
        if tokens:
            host = torch.tensor([rows, positions, tokens], dtype=torch.int64).pin_memory() \
                if torch.cuda.is_available() and self.ids.is_cuda else torch.tensor([rows, positions, tokens])
            flat = host.to(device, non_blocking=True)
            self.ids[slots[flat[0]], flat[1].clamp(max=self.capacity - 1)] = flat[2].to(torch.int32)
        ends = torch.tensor([len(ids) for ids in fill_ids], dtype=torch.int64).to(device, non_blocking=True)
        self.ids[slots, ends.clamp(max=self.capacity - 1)] = next_token_ids.to(device=device, dtype=torch.int32)

    def write_committed(self, req_pool_indices: Tensor, prefix_lens: Tensor, tokens: Tensor) -> None:
        """tokens [bs, W] committed after the anchor at prefix_lens [bs]: row b's first commit
        tokens land at positions prefix_lens[b] + 1 ... (the rest of the row is never read)."""
        bs, width = tokens.shape
        if bs == 0:
            return
        offsets = torch.arange(1, width + 1, dtype=torch.int64, device=tokens.device)
        positions = (prefix_lens.to(torch.int64)[:, None] + offsets[None]).clamp(max=self.capacity - 1)
        slots = req_pool_indices.to(torch.int64)[:, None].expand(bs, width)
        self.ids[slots, positions] = tokens.to(torch.int32)

    def prepare_draft(self, req_pool_indices: Tensor, prefix_lens: Tensor) -> None:
        """Point the static buffers at this step's bs requests (anchor at position prefix_lens)."""
        bs = req_pool_indices.shape[0]
        self.rows[:bs].copy_(req_pool_indices)
        torch.add(prefix_lens.to(torch.int64), 1, out=self.lengths[:bs])

    def window_rows(self, n: int) -> tuple[Tensor, Tensor]:
        """The last `window` tokens of the first n prepared rows: (tokens [n, window] int64,
        lengths [n] = min(length, window)); columns at or past a row's length hold stale ids that
        readers ignore. Static shapes (graph-safe)."""
        lengths = self.lengths[:n]
        start = (lengths - self.window).clamp(min=0)
        cols = (start[:, None] + self._offsets[None]).clamp(max=self.capacity - 1)
        tokens = self.ids[self.rows[:n, None], cols].to(torch.int64)
        return tokens, torch.minimum(lengths, torch.full_like(lengths, self.window))
