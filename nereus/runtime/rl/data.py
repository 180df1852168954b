"""Prompts and rule rewards from a dataset file in verl's layout, tokenized by the model's tokenizer.

File layout (verl ``examples/data_preprocess/gsm8k.py``; parquet or JSON Lines, one row per prompt)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],        # chat messages, or a plain string
     "reward_model": {"style": "rule", "ground_truth": "72"},
     ...}

The prompt field and the ground-truth field are configurable (``prompt_key``, ``answer_key`` with dots
for nesting). Chat messages go through the tokenizer's chat template when it has one (with the
generation prompt), else their contents are joined by newlines. Prompts of a batch are left-padded
with the tokenizer's pad id (its EOS when it has none) to the longest prompt of the file (capped by
``max_prompt_len``: longer prompts keep their last tokens), so every step has the same prompt length;
the runtime masks the padding (``model.left_pad``).

Reward (GSM8K style, as verl's ``gsm8k.compute_score``): the response up to EOS is decoded; its final
answer is the number after ``####`` if present, else the last number in the text; commas and a
trailing ``.0`` are dropped; 1.0 when it equals the ground truth, else 0.0.

Order: prompt ``i`` of the run is row ``perm_e[i mod n]`` of epoch ``e = i // n``, with ``perm_e`` a
permutation drawn from ``numpy.random.default_rng([seed, e])``: a function of the global index only, so
changing DP neither repeats nor skips a sample (as the built-in digit tasks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

__all__ = ["HFTokenizer", "DataTask", "read_rows", "final_answer", "write_arithmetic_dataset", "char_tokenizer"]

_NUM = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def final_answer(text: str) -> str | None:
    """The final numeric answer of ``text`` (``#### X`` first, else the last number), normalized."""
    m = re.search(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)", text)
    if m:
        s = m.group(1)
    else:
        nums = _NUM.findall(text)
        if not nums:
            return None
        s = nums[-1]
    return _norm(s)


def _norm(s: str) -> str:
    s = str(s).strip().replace(",", "").replace("$", "")
    if re.fullmatch(r"-?[0-9]+\.0+", s):
        s = s.split(".")[0]
    return s


class HFTokenizer:
    """A model directory's tokenizer (``transformers.AutoTokenizer``) with the ids the runtime needs.

    Attributes:
        eos_id: the tokenizer's EOS id (generation stops there).
        pad_id: its pad id, or the EOS id when it has none.

    Raises:
        ValueError: the directory has no loadable tokenizer, or it has no EOS token.
    """

    def __init__(self, directory: str) -> None:
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(directory)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"model directory {directory!r}: no tokenizer could be loaded ({str(e)[:200]}); "
                             "save one there with tokenizer.save_pretrained") from None
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer of {directory!r} has no eos_token; set eos_token in tokenizer_config.json")
        self.eos_id = int(self.tok.eos_token_id)
        self.pad_id = int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode_prompt(self, prompt) -> list[int]:
        """Ids of a prompt: a string, or chat messages ``[{"role", "content"}]`` (chat template if any)."""
        if isinstance(prompt, str):
            return list(self.tok(prompt)["input_ids"])
        msgs = [dict(m) for m in prompt]
        if getattr(self.tok, "chat_template", None):
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return list(self.tok(text, add_special_tokens=False)["input_ids"])
        return list(self.tok("\n".join(str(m.get("content", "")) for m in msgs))["input_ids"])

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            out.append(i)
        return self.tok.decode(out, skip_special_tokens=True)


def _get(row: dict, key: str):
    cur = row
    for part in key.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def read_rows(path: str) -> list[dict]:
    """Rows of a ``.parquet`` or ``.jsonl``/``.json`` file (a JSON file holds a list of rows).

    Raises:
        ValueError: missing file, unknown extension, unreadable or empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--data {path!r}: no such file")
    ext = p.suffix.lower()
    try:
        if ext == ".parquet":
            import pyarrow.parquet as pq

            rows = pq.read_table(str(p)).to_pylist()
        elif ext in (".jsonl", ".json"):
            text = p.read_text()
            if ext == ".json" and text.lstrip().startswith("["):
                rows = json.loads(text)
            else:
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            raise ValueError(f"--data {path!r}: extension {ext!r} is not supported; valid: .parquet, .jsonl, .json")
    except (json.JSONDecodeError, OSError) as e:
        raise ValueError(f"--data {path!r} cannot be read: {str(e)[:200]}") from None
    except Exception as e:  # pyarrow errors have no common base
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"--data {path!r} cannot be read: {str(e)[:200]}") from None
    if not rows:
        raise ValueError(f"--data {path!r} holds no rows")
    return rows


class DataTask:
    """A dataset of prompts with rule rewards; the same interface as ``task.DigitTask``.

    Args:
        path: parquet or JSONL file (module docstring).
        tokenizer: the model's :class:`HFTokenizer`.
        response_len: tokens generated per response (``target_len``).
        prompt_key, answer_key: row fields (dots for nesting).
        max_prompt_len: cap on the prompt length (tokens).
        seed: data order seed.

    Raises:
        ValueError: naming the row and field when a prompt or a ground truth is missing.
    """

    def __init__(self, path: str, tokenizer: HFTokenizer, response_len: int = 64, prompt_key: str = "prompt",
                 answer_key: str = "reward_model.ground_truth", max_prompt_len: int = 512, seed: int = 0) -> None:
        if response_len < 1:
            raise ValueError(f"--response-len must be >= 1, got {response_len}")
        if max_prompt_len < 1:
            raise ValueError(f"--max-prompt-len must be >= 1, got {max_prompt_len}")
        rows = read_rows(path)
        self.tokenizer, self.seed, self.target_len = tokenizer, int(seed), int(response_len)
        self.ids, self.answers = [], []
        for i, r in enumerate(rows):
            pr, ans = _get(r, prompt_key), _get(r, answer_key)
            if pr is None or (not isinstance(pr, str) and not isinstance(pr, list)):
                raise ValueError(f"--data {path!r} row {i}: field {prompt_key!r} must be a string or chat messages, "
                                 f"got {pr!r:.80}")
            if ans is None:
                raise ValueError(f"--data {path!r} row {i}: field {answer_key!r} (the ground truth) is missing")
            ids = tokenizer.encode_prompt(pr)
            if not ids:
                raise ValueError(f"--data {path!r} row {i}: the prompt tokenizes to nothing")
            self.ids.append(ids[-max_prompt_len:])
            self.answers.append(_norm(ans))
        self.prompt_len = max(len(x) for x in self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def row_of(self, index: int) -> int:
        n = len(self.ids)
        e, k = divmod(int(index), n)
        return int(np.random.default_rng([self.seed, e]).permutation(n)[k])

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError when the model's ``vocab_size`` cannot hold the tokenizer's ids."""
        if vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model vocab_size={vocab_size} is smaller than the tokenizer's "
                             f"{self.tokenizer.vocab_size} tokens")

    def prompts(self, start: int, count: int) -> tuple[torch.Tensor, list[int]]:
        """Left-padded prompt ids ``[count, prompt_len]`` of global indices ``start..start+count-1``."""
        idx = list(range(start, start + count))
        pad = self.tokenizer.pad_id
        out = torch.full((count, self.prompt_len), pad, dtype=torch.long)
        for j, i in enumerate(idx):
            ids = self.ids[self.row_of(i)]
            out[j, self.prompt_len - len(ids):] = torch.tensor(ids)
        return out, idx

    def reward(self, index: int, response) -> float:
        """1.0 when the response's final answer equals the ground truth (module docstring), else 0.0."""
        got = final_answer(self.tokenizer.decode(response))
        return float(got is not None and got == self.answers[self.row_of(index)])

    def rewards(self, indices: list[int], responses: torch.Tensor) -> torch.Tensor:
        """Rule rewards ``[B]`` (float32)."""
        return torch.tensor([self.reward(i, r) for i, r in zip(indices, responses)], dtype=torch.float32)


# ---------------------------------------------------------------------- demo data and tokenizer
def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (digits, letters, punctuation; ``<pad>=0``,
    ``<s>=1``, ``</s>=2``) for models created in tests and demos, where nothing can be downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(" 0123456789+-*/=?.,#:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def write_arithmetic_dataset(path: str, n: int, seed: int = 0) -> str:
    """Write ``n`` GSM8K-style rows ``"What is a + b?"`` with ground truth ``a+b`` in verl's layout
    (parquet or JSONL by the extension of ``path``); returns ``path``."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        rows.append({"data_source": "nereus/arithmetic",
                     "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer after ####."}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                     "extra_info": {"index": i}})
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
