"""The built-in verifiable task: digit reversal or addition, with our own tokenizer and a rule reward.

Prompts have a fixed length (``BOS d1 … dn =`` for ``reverse``; ``BOS a1 … an + b1 … bn =`` for
``add``), so a batch needs no padding. The target is the reversed digits (or the zero-padded
``n+1``-digit sum) followed by ``EOS``. The rule reward is the fraction of target positions the
response matches, in [0, 1]: dense enough that a tiny model trained from scratch shows progress.

Prompt ``i`` of the run is drawn from ``numpy.random.default_rng([seed, i])``: a function of its
*global* index only, so the data order survives any change of DP degree (no sample repeats or is
skipped; DESIGN.md §2 "dataloader state derived from (dp rank, p)").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Tokenizer", "DigitTask"]


class Tokenizer:
    """Character tokenizer: ``<pad>=0, <bos>=1, <eos>=2, '='=3, '0'..'9'=4..13, '+'=14``."""

    SPECIAL = ("<pad>", "<bos>", "<eos>")
    CHARS = "=0123456789+"
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self) -> None:
        self.itos = list(self.SPECIAL) + list(self.CHARS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``'s characters.

        Raises:
            ValueError: a character outside the vocabulary.
        """
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise ValueError(f"tokenizer: characters {bad} are not in the vocabulary {self.CHARS!r}")
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(self.itos):
                out.append("?")
            elif i >= len(self.SPECIAL):
                out.append(self.itos[i])
        return "".join(out)


@dataclass(frozen=True)
class DigitTask:
    """A verifiable task of ``num_digits``-digit strings.

    Attributes:
        kind: ``reverse`` or ``add``.
        num_digits: digits per operand, 1..8.
        seed: data seed.

    Raises:
        ValueError: unknown kind or digits out of range.
    """

    kind: str = "reverse"
    num_digits: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("reverse", "add"):
            raise ValueError(f"task field 'kind' must be 'reverse' or 'add', got {self.kind!r}")
        if isinstance(self.num_digits, bool) or not isinstance(self.num_digits, int) or not 1 <= self.num_digits <= 8:
            raise ValueError(f"task field 'num_digits' must be an integer in 1..8, got {self.num_digits!r}")

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer()

    @property
    def prompt_len(self) -> int:
        n = self.num_digits
        return n + 2 if self.kind == "reverse" else 2 * n + 3

    @property
    def target_len(self) -> int:
        """Target tokens including EOS."""
        return self.num_digits + 1 if self.kind == "reverse" else self.num_digits + 2

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError when a model's ``vocab_size`` cannot hold the tokenizer's ids."""
        if vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model vocab_size={vocab_size} is smaller than the task tokenizer's "
                             f"{self.tokenizer.vocab_size} tokens; use a model with vocab_size >= "
                             f"{self.tokenizer.vocab_size}")

    def _operands(self, index: int) -> tuple[str, str]:
        rng = np.random.default_rng([self.seed, int(index)])
        digits = rng.integers(0, 10, size=2 * self.num_digits)
        return ("".join(map(str, digits[:self.num_digits])), "".join(map(str, digits[self.num_digits:])))

    def prompt_text(self, index: int) -> str:
        a, b = self._operands(index)
        return f"{a}=" if self.kind == "reverse" else f"{a}+{b}="

    def target_text(self, index: int) -> str:
        a, b = self._operands(index)
        if self.kind == "reverse":
            return a[::-1]
        return str(int(a) + int(b)).zfill(self.num_digits + 1)

    def prompts(self, start: int, count: int) -> tuple[torch.Tensor, list[int]]:
        """Prompt ids ``[count, prompt_len]`` of global indices ``start .. start+count-1``, and the indices."""
        tok = self.tokenizer
        idx = list(range(start, start + count))
        ids = [[tok.bos_id] + tok.encode(self.prompt_text(i)) for i in idx]
        return torch.tensor(ids, dtype=torch.long), idx

    def reward(self, index: int, response) -> float:
        """Fraction of the target (digits then EOS) that ``response`` ids match position by position."""
        tok = self.tokenizer
        target = tok.encode(self.target_text(index)) + [tok.eos_id]
        resp = [int(x) for x in response][:len(target)]
        hits = sum(1 for a, b in zip(resp, target) if a == b)
        return hits / len(target)

    def rewards(self, indices: list[int], responses: torch.Tensor) -> torch.Tensor:
        """Rule rewards ``[B]`` (float32)."""
        return torch.tensor([self.reward(i, r) for i, r in zip(indices, responses)], dtype=torch.float32)
