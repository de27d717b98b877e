"""Training batches: sequences -> random block anchors, draft attention masks and labels.

For a sequence of L tokens with target hidden states h[0..L-1], a block anchored at position a
has the anchor token ids[a] at slot 0 and predicts ids[a+1 .. a+B-1] at slots 1..B-1, seeing only
the context h[j] for a - window <= j < a — exactly what the drafter sees at inference after the
target verified tokens 0..a-1 and emitted ids[a] as the bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class BlockBatch:
    """input_ids/valid: [bs, L] right-padded sequences; anchors: [bs, nb] anchor positions;
    anchor_ids: [bs, nb]; block_positions: [bs, nb·B]; labels: [bs·nb, B-1] (-100 = ignore).
    `mask` ([bs, nb·B, L + nb·B] bool draft attention mask) is built where the batch lives, so a
    batch moves to the device as these small tensors."""

    input_ids: Tensor
    valid: Tensor
    anchors: Tensor
    anchor_ids: Tensor
    block_positions: Tensor
    labels: Tensor
    block_size: int
    window: int

    _tensors = ("input_ids", "valid", "anchors", "anchor_ids", "block_positions", "labels")

    def to(self, device) -> "BlockBatch":
        """On `device`; to CUDA through pinned memory without blocking, so the host can build the
        next batch while the device still works on this one."""
        cuda = torch.device(device).type == "cuda"
        moved = {f: (getattr(self, f).pin_memory().to(device, non_blocking=True) if cuda
                     else getattr(self, f).to(device)) for f in self._tensors}
        return BlockBatch(**moved, block_size=self.block_size, window=self.window)

    @property
    def mask(self) -> Tensor:
        """[bs, nb·B, L + nb·B] bool: slot queries of block k see the context positions j with
        anchor_k - window <= j < anchor_k that are valid, and the B slots of block k itself."""
        bs, nb = self.anchors.shape
        length, block = self.input_ids.shape[1], self.block_size
        ctx = torch.arange(length, device=self.anchors.device)
        a = self.anchors[..., None]
        ctx_mask = (ctx < a) & (ctx >= a - self.window) & self.valid[:, None]               # [bs, nb, L]
        ctx_mask = ctx_mask[:, :, None].expand(bs, nb, block, length).reshape(bs, nb * block, length)
        blk = torch.arange(nb * block, device=self.anchors.device) // block
        return torch.cat([ctx_mask, (blk[:, None] == blk[None])[None].expand(bs, -1, -1)], dim=2)

    def block_mask(self, tile: int = 128):
        """`mask` as a FlexAttention `BlockMask` over tiles of `tile` queries × `tile` keys, built from
        the anchors alone (no [bs, nb·B, L + nb·B] tensor): a query tile lists the key tiles that meet
        its blocks' windows [anchor - window, anchor) or hold its own slots (keys L + its queries);
        the mask function then decides each entry, so attention skips every other tile. Anchors
        ascend within a row (`draw_anchors`), so a query tile's windows span [first anchor - window,
        last anchor)."""
        from torch.nn.attention.flex_attention import BlockMask

        bs, nb = self.anchors.shape
        length, block, window = self.input_ids.shape[1], self.block_size, self.window
        queries, device = nb * block, self.anchors.device
        q_tiles, kv_tiles = -(-queries // tile), -(-(length + queries) // tile)
        q_first = torch.arange(q_tiles, device=device) * tile                            # first query of a tile
        q_last = (q_first + tile - 1).clamp(max=queries - 1)
        lo = (self.anchors[:, q_first // block] - window).clamp(min=0)                   # [bs, q_tiles]
        hi = torch.minimum(self.anchors[:, q_last // block], self.valid.sum(1, keepdim=True))  # exclusive
        starts = torch.arange(kv_tiles, device=device) * tile
        windows = (starts < hi[..., None]) & (starts + tile > lo[..., None]) & (hi > lo)[..., None]
        kv_tile = torch.arange(kv_tiles, device=device)
        own = (kv_tile >= ((length + q_first) // tile)[:, None]) & (kv_tile <= ((length + q_last) // tile)[:, None])
        tiles = (windows | own)[:, None]                                                # [bs, 1, q_tiles, kv_tiles]
        anchors, valid = self.anchors, self.valid

        def allowed(b, h, q, kv):
            a = anchors[b, (q // block).clamp(max=nb - 1)]
            in_window = (kv < a) & (kv >= a - window) & valid[b, kv.clamp(max=length - 1)]
            return in_window | ((kv - length) // block == q // block)

        return BlockMask.from_kv_blocks(tiles.sum(-1, dtype=torch.int32),
                                        torch.argsort(~tiles, dim=-1, stable=True).to(torch.int32),
                                        BLOCK_SIZE=tile, mask_mod=allowed, seq_lengths=(queries, length + queries))


def draw_anchors(starts: Tensor, count: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """`count` anchors from the candidate positions `starts` [m]: without replacement (ascending),
    or, when m < count, all m once and count - m repeats drawn among them. Returns (anchors [count],
    repeat [count] bool): a repeat's labels are ignored, so every anchor weighs the same whatever its
    sequence's answer length."""
    m = len(starts)
    if m >= count:
        picked = starts[torch.randperm(m, generator=generator)[:count]]
        return picked.sort().values, torch.zeros(count, dtype=torch.bool)
    chosen = torch.cat([starts, starts[torch.randint(m, (count - m,), generator=generator)]])
    order = chosen.sort(stable=True).indices
    return chosen[order], order >= m


def make_block_batch(records: list[dict], *, block_size: int, blocks_per_seq: int, window: int, max_len: int,
                     generator: torch.Generator, length_multiple: int = 64) -> BlockBatch:
    """Pad `records` ({"ids", "answer_start"}) to one batch and draw `blocks_per_seq` anchors each
    among the answer positions (`draw_anchors`: distinct ones; a short answer's repeats carry no
    labels). The padded length
    is a multiple of `length_multiple`: few distinct shapes, so attention backends reuse their
    per-shape plans (cuDNN's cost milliseconds of CPU each).

    A record with `answer_spans` ([[start, end), ...], multi-turn gen-data) has its answer in those
    spans only: anchors a are drawn where a and a + 1 lie in a span, and labels outside every span
    (the template and the real user/tool turns between answers) are -100. Without spans the answer
    runs from `answer_start` to the end, as before."""
    seqs = [r["ids"][:max_len] for r in records]
    bs, longest = len(seqs), max(len(s) for s in seqs)
    length = -(-longest // length_multiple) * length_multiple
    input_ids = torch.zeros(bs, length, dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs])
    valid = torch.arange(length)[None] < lens[:, None]
    anchors = torch.empty(bs, blocks_per_seq, dtype=torch.long)
    repeats = torch.zeros(bs, blocks_per_seq, dtype=torch.bool)
    in_answer = torch.ones(bs, length, dtype=torch.bool)      # label positions; answer_spans narrow them
    for b, r in enumerate(records):
        n = len(seqs[b])
        starts = None
        if r.get("answer_spans"):
            in_answer[b] = False
            for start, end in r["answer_spans"]:
                in_answer[b, start:min(end, n)] = True
            starts = (in_answer[b, 1:n - 1] & in_answer[b, 2:n]).nonzero().flatten() + 1
        if starts is None or not len(starts):
            lo = min(max(r["answer_start"], 1), n - 2)   # an anchor needs context and a next token
            starts = torch.arange(lo, n - 1)
        anchors[b], repeats[b] = draw_anchors(starts, blocks_per_seq, generator)
    offsets = torch.arange(block_size)
    slot_pos = anchors[..., None] + offsets                                           # [bs, nb, B]
    flat_pos = slot_pos.clamp(max=length - 1).view(bs, -1)
    labels = input_ids.gather(1, flat_pos).view(bs, blocks_per_seq, block_size)
    outside = (slot_pos >= lens[:, None, None]) | ~in_answer.gather(1, flat_pos).view_as(slot_pos)
    outside |= repeats[..., None]
    labels = labels.masked_fill(outside, -100)[..., 1:]                               # [bs, nb, B-1]
    return BlockBatch(input_ids, valid, anchors, input_ids.gather(1, anchors), slot_pos.view(bs, -1),
                      labels.reshape(bs * blocks_per_seq, block_size - 1), block_size, window)
