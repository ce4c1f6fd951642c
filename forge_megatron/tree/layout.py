"""The DFS layout of a prefix forest and the maps between tree tokens and sample tokens.

A batch of samples (token sequences) is merged into a trie; every unique root-to-node path appears once.
The trie's tokens are laid out in DFS pre-order, so the subtree of token j is the contiguous range
``[j, sub_end[j])`` and the attention mask is one rule (see docs/prefix_tree.md):

    key j is visible to query i   <=>   j <= i < sub_end[j]      (j is an ancestor of i, or i itself)

Every sample is a root-to-node path; ``sample_nodes`` records the tree index of each of its tokens, so any
per-tree-token output (hidden states, logits) is gathered back per sample, and autograd sums the gradient of
shared tokens over the samples that contain them.

Legend: T = unique tree tokens, S = samples, P = sample tokens of all samples (sum of lengths),
M = next-token targets of all samples (P - S).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeLayout:
    """A prefix forest in DFS pre-order plus the token map of every sample.

    Attributes:
        tokens: int64 [T], token id of every unique tree token, DFS pre-order.
        position_ids: int64 [T], depth of every tree token (its position in any sample containing it).
        sub_end: int32 [T], exclusive end of the subtree rooted at every tree token.
        sample_offsets: int64 [S+1], cumulative sample lengths.
        sample_nodes: int64 [P], tree index of every token of every sample, samples concatenated.
        vision: for samples with images, the tree's :class:`~forge_megatron.multimodal.tree.VisionTree` (the images,
            each tree token's feature row and mRoPE positions); None for text.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    sub_end: torch.Tensor
    sample_offsets: torch.Tensor
    sample_nodes: torch.Tensor
    vision: object = None

    @property
    def num_samples(self) -> int:
        return self.sample_offsets.numel() - 1

    @property
    def total_tokens(self) -> int:
        """Sum of sample lengths (what unmerged training would process)."""
        return self.sample_nodes.numel()

    @property
    def unique_tokens(self) -> int:
        """Tokens in the tree (what merged training processes)."""
        return self.tokens.numel()

    def sample_slice(self, s: int) -> slice:
        """The range of sample ``s`` in ``sample_nodes`` and in any per-sample-token array."""
        if not 0 <= s < self.num_samples:
            raise IndexError(f"sample index {s} out of range for a layout of {self.num_samples} samples")
        return slice(int(self.sample_offsets[s]), int(self.sample_offsets[s + 1]))

    def gather(self, x_T):
        """Per-tree-token field [T, ...] -> per-sample-token field [P, ...] (differentiable for tensors)."""
        if x_T.shape[0] != self.unique_tokens:
            raise ValueError(
                f"gather expects a leading dimension of {self.unique_tokens} tree tokens, got {tuple(x_T.shape)}"
            )
        if isinstance(x_T, torch.Tensor):
            return x_T[self.sample_nodes.to(x_T.device)]
        return x_T[self.sample_nodes.numpy()]

    def next_token_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each sample's next-token predictions live in the tree.

        Returns ``(pred_nodes_M, targets_M, target_offsets_S1)``: for sample s and t in 1..L_s-1, the tree
        node of token t-1 (whose output predicts token t), the id of token t, and cumulative counts L_s - 1.
        ``logp[m] = log_softmax(logits[pred_nodes[m]])[targets[m]]``.
        """
        starts_S = self.sample_offsets[:-1]
        ends_S = self.sample_offsets[1:]
        device = self.sample_nodes.device
        is_last_P = torch.zeros(self.total_tokens, dtype=torch.bool, device=device)
        is_last_P[ends_S - 1] = True
        is_first_P = torch.zeros(self.total_tokens, dtype=torch.bool, device=device)
        is_first_P[starts_S] = True
        pred_nodes_M = self.sample_nodes[~is_last_P]
        targets_M = self.tokens[self.sample_nodes[~is_first_P]]
        counts_S = ends_S - starts_S - 1
        target_offsets_S1 = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(counts_S, 0)])
        return pred_nodes_M, targets_M, target_offsets_S1

    def padded(self, length: int) -> "TreeLayout":
        """This forest plus ``length - T`` padding tokens, each a single-token root (token 0, depth 0, visible only to
        itself, in no sample): same samples, same logprobs, a fixed length (what a fixed-shape pipeline needs)."""
        extra = length - self.unique_tokens
        if extra < 0:
            raise ValueError(f"cannot pad a forest of {self.unique_tokens} tokens to {length}")
        if extra == 0:
            return self
        T = self.unique_tokens
        return TreeLayout(
            tokens=torch.cat([self.tokens, self.tokens.new_zeros(extra)]),
            position_ids=torch.cat([self.position_ids, self.position_ids.new_zeros(extra)]),
            sub_end=torch.cat([self.sub_end, torch.arange(T + 1, length + 1, dtype=self.sub_end.dtype,
                                                          device=self.sub_end.device)]),
            sample_offsets=self.sample_offsets, sample_nodes=self.sample_nodes,
            vision=None if self.vision is None else self.vision.padded(length))

    def with_tokens(self, tokens: torch.Tensor, vision=None) -> "TreeLayout":
        """This forest with other token ids (the same shape) and ``vision``: a tree built on keys standing for tokens
        (multimodal/tree.py) given back its token ids."""
        if tokens.shape != self.tokens.shape:
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} for a forest of {self.unique_tokens}")
        return TreeLayout(tokens, self.position_ids, self.sub_end, self.sample_offsets, self.sample_nodes, vision)

    def to(self, device) -> "TreeLayout":
        """A copy with every array on ``device``."""
        return TreeLayout(*(getattr(self, f).to(device) for f in _FIELDS), vision=self.vision)


_FIELDS = ("tokens", "position_ids", "sub_end", "sample_offsets", "sample_nodes")
