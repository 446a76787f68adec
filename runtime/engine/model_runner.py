"""Turns a scheduled batch into the step's metadata and runs the model once."""

from __future__ import annotations

import torch

from runtime.engine.block_manager import BlockManager
from runtime.engine.kv_cache import KVCache
from runtime.engine.scheduler import Batch
from runtime.model.context import DecodeBatch, KernelTensors, StepContext, set_context
from runtime.model.llama import LlamaModel


class ModelRunner:
    def __init__(
        self, model: LlamaModel, cache: KVCache, blocks: BlockManager, backend: str = "cpu"
    ) -> None:
        self.model = model
        self.cache = cache
        self.blocks = blocks
        self.block_size = cache.spec.block_size
        self.backend = backend
        self.device = cache.device

    def run(self, batch: Batch) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Logits of each sequence's last new token ([B, V], float32), and for sequences that
        asked for prompt logprobs the logits of every new token of the chunk."""
        ids, positions, slots, tables, ctx_lens, rows, all_rows = [], [], [], [], [], [], []
        start = 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            first = seq.num_computed
            table = torch.tensor(self.blocks.block_table(seq.seq_id), dtype=torch.int64)
            pos = torch.arange(first, first + n)
            ids.extend(seq.token_ids[first : first + n])
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            tables.append(table)
            ctx_lens.append(first + n)
            wants_all = seq.params.prompt_logprobs is not None and first < seq.num_prompt
            all_rows.append(torch.arange(start, start + n) if wants_all else None)
            rows.append(start + n - 1)
            start += n
        wanted = sorted({*rows, *(r for a in all_rows if a is not None for r in a.tolist())})
        index = {r: i for i, r in enumerate(wanted)}
        dev = self.device
        ctx = StepContext(
            positions=torch.cat(positions).to(dev),
            slot_mapping=torch.cat(slots).to(dev),
            block_tables=tables,
            context_lens=ctx_lens,
            query_lens=list(batch.num_tokens),
            logits_indices=torch.tensor(wanted, dtype=torch.int64, device=dev),
            cache=self.cache,
        )
        if self.backend == "cpu":
            ctx.decode = decode_batch(
                tables,
                ctx_lens,
                batch.num_tokens,
                rows,
                self.block_size,
                self.model.arch.sliding_window,
            )
        else:
            ctx.tensors = kernel_tensors(tables, ctx_lens, batch.num_tokens, dev)
        set_context(ctx)
        try:
            logits = self.model(torch.tensor(ids, dtype=torch.int64, device=dev)).cpu()
        finally:
            set_context(None)
        last = logits[[index[r] for r in rows]]
        chunks = [None if a is None else logits[[index[r] for r in a.tolist()]] for a in all_rows]
        return last, chunks


def kernel_tensors(
    tables: list[torch.Tensor], ctx_lens: list[int], num_tokens: list[int], device: torch.device
) -> KernelTensors:
    """Padded block tables and lengths, copied to the device once per step for all layers."""
    padded = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True).to(torch.int32)
    cu = torch.zeros(len(num_tokens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(num_tokens).cumsum(0)
    return KernelTensors(
        block_tables=padded.to(device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32).to(device),
        cu_query_lens=cu.to(device),
        all_decode=all(n == 1 for n in num_tokens),
    )


def decode_batch(
    tables: list[torch.Tensor],
    ctx_lens: list[int],
    num_tokens: list[int],
    rows: list[int],
    block_size: int,
    window: int | None,
) -> DecodeBatch | None:
    """Padded block tables of every decoding sequence, built once per step for all layers:
    attention gathers whole blocks (contiguous runs of block_size tokens), not single slots."""
    picked = [i for i, n in enumerate(num_tokens) if n == 1]
    if not picked:
        return None
    lens = torch.tensor([ctx_lens[i] for i in picked])
    needed = -(-int(lens.max()) // block_size)
    blocks = torch.nn.utils.rnn.pad_sequence([tables[i] for i in picked], batch_first=True)
    pos = torch.arange(needed * block_size)
    valid = pos[None, :] < lens[:, None]
    if window is not None:
        valid &= pos[None, :] > (lens[:, None] - 1 - window)
    return DecodeBatch(
        torch.tensor([rows[i] for i in picked]), blocks[:, :needed].contiguous(), valid, lens
    )
