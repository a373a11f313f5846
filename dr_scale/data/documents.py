"""Where the documents of a packed sample begin and end, read from its end-of-document tokens.

A packed sample lays documents end to end, each closed by the end-of-document (EOD) token. With
`data.document_mask` a token attends only to earlier tokens of its own document; with
`data.reset_positions` its position counts from its document's first token, as if the document
had been run alone (Megatron's `reset_attention_mask` / `reset_position_ids`). The sample itself
stays a plain token array: both are derived from the tokens here, on the device, per batch.

Document ids are what the attention kernels take: an int32 (batch, seq) tensor, non-decreasing
along the sequence (the number of EOD tokens before each position), so one document is one
contiguous run and a kernel can skip key blocks that share no document with its query block.
"""
from typing import Dict, Optional

import torch


def document_ids(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(batch, seq) int32: how many EOD tokens come before each position (the EOD closing a
    document belongs to that document; the token after it starts the next one)."""
    is_eod = (input_ids == eod_id).to(torch.int32)
    return (torch.cumsum(is_eod, dim=1, dtype=torch.int32) - is_eod)


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int64: each token's distance from its document's first token."""
    seq = doc_ids.shape[1]
    index = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def same_document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, seq, seq) bool, True where query i may attend key j: j <= i, same document."""
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[:, :, None] == doc_ids[:, None, :]).unsqueeze(1) & causal


class DocumentBoundaries:
    """What the model is given beside the tokens of a batch, from `data.document_mask` and
    `data.reset_positions`: nothing when both are off (attention over the whole packed sample,
    positions 0..seq-1, the behaviour of GPT-style pretraining)."""

    def __init__(self, eod_id: int, mask: bool, reset_positions: bool):
        self.eod_id, self.mask, self.reset_positions = eod_id, mask, reset_positions

    @classmethod
    def of(cls, data_cfg, tokenizer) -> "DocumentBoundaries":
        return cls(tokenizer.eod_id, data_cfg.document_mask, data_cfg.reset_positions)

    @property
    def active(self) -> bool:
        return self.mask or self.reset_positions

    def model_inputs(self, input_ids: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
        """Keyword arguments for the model's forward: `doc_ids` and/or `position_ids`."""
        if not self.active:
            return {}
        doc_ids = document_ids(input_ids, self.eod_id)
        out = {}
        if self.mask:
            out["doc_ids"] = doc_ids
        if self.reset_positions:
            out["position_ids"] = positions_in_document(doc_ids)
        return out

    def pipeline_inputs(self, input_ids: torch.Tensor):
        """The first pipeline stage's input: the tokens, or (tokens, document ids, positions)
        when packed documents are kept apart (the stages pass the latter two along; a pipeline
        carries tensors only, so both travel whichever flag is on)."""
        if not self.active:
            return input_ids
        doc_ids = document_ids(input_ids, self.eod_id)
        return input_ids, doc_ids, positions_in_document(doc_ids)

    def describe(self) -> str:
        """The start line's words, when active."""
        parts = (["attention within each document"] if self.mask else []) + \
            (["positions restart at each document"] if self.reset_positions else [])
        return f"documents: packed, {', '.join(parts)} (end-of-document id {self.eod_id})"
