"""Token-based batching (paper Section 5.1; fairseq's `--max-tokens`).

Sentence pairs of similar length are grouped so that each batch holds about `max_tokens` source
plus target tokens, padding included, instead of a fixed number of sentences.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler


class TokenBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices whose padded source + target size stays within `max_tokens`.

    A batch of n pairs costs n * (longest source + longest target) tokens, which is what the model
    computes on (training's stutter augmentation, `add_stutters`, lengthens the targets afterwards).
    Every example appears exactly once per epoch. Pairs are sorted by length (ties broken at random each
    epoch), packed greedily, and the batch order is shuffled each epoch (`set_epoch`).

    With `num_shards` > 1 (data-parallel processes) the number of batches is made a multiple of
    `num_shards` by halving the largest batches, so that sharding the batch list round-robin (as
    Accelerate does) gives every process the same number of batches without repeating any example.
    All processes must construct the sampler with the same arguments.
    """

    def __init__(
        self,
        source_lengths: Sequence[int],
        target_lengths: Sequence[int],
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_shards: int = 1,
    ):
        if len(source_lengths) != len(target_lengths):
            raise ValueError(
                f"Got {len(source_lengths)} source lengths but {len(target_lengths)} target lengths."
            )
        if max_tokens <= 0 or num_shards <= 0:
            raise ValueError(
                f"max_tokens and num_shards must be positive, got {max_tokens} and {num_shards}."
            )
        costs = [s + t for s, t in zip(source_lengths, target_lengths, strict=True)]
        if costs and max(costs) > max_tokens:
            longest = max(range(len(costs)), key=costs.__getitem__)
            raise ValueError(
                f"Example {longest} alone has {costs[longest]} source + target tokens, more than max_tokens="
                f"{max_tokens}. Raise max_tokens or filter long examples (max_length)."
            )
        self.source_lengths = list(source_lengths)
        self.target_lengths = list(target_lengths)
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.num_shards = num_shards
        self.epoch = 0
        self._batches: list[list[int]] | None = None
        if len(self.source_lengths) < num_shards:
            raise ValueError(
                f"{len(self.source_lengths)} examples cannot fill a batch on each of {num_shards} processes."
            )
        self._build()  # fail now, not in the first epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle to produce (call before each epoch)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._batches = None

    @property
    def sampler(self) -> TokenBatchSampler:
        """Itself, as the sampler whose epoch is set. A loader prepared by Accelerate sets its epoch at
        each iteration, but with several processes it wraps the batch sampler (`BatchSamplerShard`) and
        reaches a wrapped one's `set_epoch` only through `.sampler`: without this, every epoch of a
        multi-process loop repeated the first one's batch order."""
        return self

    def _build(self) -> list[list[int]]:
        if self._batches is not None:
            return self._batches
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.source_lengths)))
        if self.shuffle:
            rng.shuffle(order)  # random tie-breaking inside the (stable) length sort
        order.sort(key=lambda i: (self.source_lengths[i], self.target_lengths[i]))

        batches: list[list[int]] = []
        batch: list[int] = []
        longest_source = longest_target = 0
        for index in order:
            source = max(longest_source, self.source_lengths[index])
            target = max(longest_target, self.target_lengths[index])
            if batch and (len(batch) + 1) * (source + target) > self.max_tokens:
                batches.append(batch)
                batch, source, target = [], self.source_lengths[index], self.target_lengths[index]
            batch.append(index)
            longest_source, longest_target = source, target
        if batch:
            batches.append(batch)

        while len(batches) % self.num_shards and any(len(b) > 1 for b in batches):
            largest = max(range(len(batches)), key=lambda i: len(batches[i]))
            half = math.ceil(len(batches[largest]) / 2)
            batches[largest : largest + 1] = [batches[largest][:half], batches[largest][half:]]
        if len(batches) % self.num_shards:
            raise ValueError(
                f"Cannot split {len(self.source_lengths)} examples into a multiple of {self.num_shards} "
                "batches (one per process); use fewer processes or more data."
            )
        if self.shuffle:
            rng.shuffle(batches)
        self._batches = batches
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._build()

    def __len__(self) -> int:
        return len(self._build())


__all__ = ["TokenBatchSampler"]
