"""The runtime's tokenizers: tokenizer.json (tokenizers) and Kimi's tiktoken.model (tiktoken)."""

import base64
import json

from kimi_iree.frontend.synthetic import byte_level_tokenizer
from kimi_iree.runtime.tokenizer import Tokenizer


def test_tiktoken_model_file(tmp_path):
    # ranks: the 256 single bytes, then one merge ("th")
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    lines.append(f"{base64.b64encode(b'th').decode()} 256")
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    tok = Tokenizer(tmp_path, ["tiktoken.model"])
    ids = tok.encode("the cat")
    assert ids[0] == 256 and tok.decode(ids) == "the cat"


def test_tokenizer_json_with_bos(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer(512)))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<|bos|>"}))
    tok = Tokenizer(tmp_path, ["tokenizer.json", "tokenizer_config.json"])
    assert tok.encode("hé") == [509, 104, 195, 169] and tok.decode([104, 195, 169]) == "hé"
