"""Data for the reference trainer: a generated corpus, a character tokenizer, and a sampler over
global sample indices whose state does not depend on the data-parallel size."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

import torch
import xxhash

SPECIALS = ("<unk>", "<eos>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "builds", "paints", "finds", "carries", "watches", "follows"]
_OBJECTS = ["a red ball", "the green door", "two apples", "the tall tree", "a quiet river", "the blue box", "many stars"]
_PLACES = ["in the park", "at home", "near the sea", "under the bridge", "on the hill", "in the morning", "at night"]


def generate_corpus(seed: int = 0, sentences: int = 6000) -> str:
    """Return a deterministic English-like text: simple sentences a small model can learn."""
    rng = random.Random(seed)
    lines = []
    for i in range(sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
        lines.append(s.capitalize() + ("\n" if i % 5 == 4 else " "))
    return "".join(lines)


class Tokenizer:
    """Characters of printable ASCII (and newline) plus <unk> and <eos>; saved as tokenizer.json."""

    def __init__(self) -> None:
        self.vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARS])}

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        unk = self.vocab["<unk>"]
        return torch.tensor([self.vocab.get(c, unk) for c in text], dtype=torch.int64)

    def decode(self, ids: list[int]) -> str:
        inverse = {i: t for t, i in self.vocab.items()}
        return "".join(inverse[i] if len(inverse[i]) == 1 else "" for i in ids)

    def save(self, directory: str) -> str:
        """Write tokenizer.json (Hugging Face tokenizers layout, a word-level model over characters)."""
        os.makedirs(directory, exist_ok=True)
        doc = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                 "normalized": False, "special": True}
                for i, t in enumerate(SPECIALS)
            ],
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": False},
            "post_processor": None,
            "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": self.vocab, "unk_token": "<unk>"},
        }
        path = os.path.join(directory, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        return path


@dataclass(frozen=True)
class Dataset:
    """Fixed-length samples cut from one token stream: sample i is tokens[i*L : i*L + L + 1]."""

    tokens: torch.Tensor
    seq_len: int
    fingerprint: str

    @property
    def num_samples(self) -> int:
        return (self.tokens.numel() - 1) // self.seq_len

    def sample(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


def load_dataset(corpus: str | None, tokenizer: Tokenizer, seq_len: int, seed: int = 0) -> tuple[Dataset, str]:
    """Return the dataset and its id: the given text file, or the generated corpus."""
    if corpus is None:
        text, dataset_id = generate_corpus(seed), f"generated-corpus-v1-seed{seed}"
    else:
        with open(corpus, encoding="utf-8", errors="replace") as f:
            text = f.read()
        dataset_id = os.path.basename(corpus)
    tokens = tokenizer.encode(text)
    fingerprint = "xxh3-128:" + xxhash.xxh3_128(tokens.numpy().tobytes()).hexdigest()
    return Dataset(tokens, seq_len, fingerprint), dataset_id


@dataclass
class Sampler:
    """Global sample order: epoch e visits a permutation seeded by (seed, e); a step takes the next
    `global_batch` positions. The state (seed, consumed samples and tokens) is the same whatever the
    data-parallel size, so a resume at another size continues with exactly the next samples."""

    num_samples: int
    seed: int
    consumed_samples: int = 0
    consumed_tokens: int = 0

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def _permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def next_ids(self, count: int) -> list[int]:
        """Return the global sample ids of the next `count` positions (does not advance)."""
        ids: list[int] = []
        position = self.consumed_samples
        perm_epoch, perm = -1, torch.empty(0, dtype=torch.int64)
        while len(ids) < count:
            epoch = position // self.num_samples
            if epoch != perm_epoch:
                perm_epoch, perm = epoch, self._permutation(epoch)
            ids.append(int(perm[position % self.num_samples]))
            position += 1
        return ids

    def advance(self, samples: int, tokens: int) -> None:
        self.consumed_samples += samples
        self.consumed_tokens += tokens
