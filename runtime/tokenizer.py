"""The checkpoint's tokenizer: `tokenizer.json` through `tokenizers`, or Kimi's `tiktoken.model`
through `tiktoken` (the BPE ranks file, with the K2/K3 pre-tokenizer pattern)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from .errors import RuntimeUsageError

# Kimi-K2's tiktoken pattern (tokenization_kimi.py): CJK runs, cased words, numbers up to 3 digits, ...
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+""",
])


class Tokenizer:
    def __init__(self, directory: Path, files: list[str]):
        self.add_bos = False
        self.bos_id: int | None = None
        config = directory / "tokenizer_config.json"
        if config.exists():
            cfg = json.loads(config.read_text())
            self.add_bos = bool(cfg.get("add_bos_token", False))
        if "tokenizer.json" in files and (directory / "tokenizer.json").exists():
            from tokenizers import Tokenizer as HFTokenizer
            self._hf = HFTokenizer.from_file(str(directory / "tokenizer.json"))
            self._tt = None
            if self.add_bos and config.exists():
                bos = json.loads(config.read_text()).get("bos_token")
                bos = bos.get("content") if isinstance(bos, dict) else bos
                self.bos_id = self._hf.token_to_id(bos) if bos else None
        elif "tiktoken.model" in files and (directory / "tiktoken.model").exists():
            import tiktoken
            ranks = {}
            for line in (directory / "tiktoken.model").read_text().splitlines():
                if line.strip():
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
            self._tt = tiktoken.Encoding(name="kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
            self._hf = None
        else:
            raise RuntimeUsageError(f"{directory}: no tokenizer.json or tiktoken.model; pass --prompt-ids")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with the BOS the checkpoint asks for unless `add_bos` is False (a rendered
        chat template writes its own). Special tokens written in the text become their ids."""
        ids = self._hf.encode(text, add_special_tokens=False).ids if self._hf else self._tt.encode(text)
        bos = [self.bos_id] if add_bos and self.add_bos and self.bos_id is not None else []
        return bos + list(ids)

    def decode(self, ids: list[int]) -> str:
        if self._hf:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._tt.decode(ids)
