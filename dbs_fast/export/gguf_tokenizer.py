"""A SentencePiece-style BPE tokenizer rebuilt from a GGUF file's own vocabulary.

transformers 4.57 loads Gemma 3 GGUF weights correctly but converts its GGUF tokenizer wrongly
(it encodes "the" as `▁t` + `he`, and a fluent sentence then scores perplexity ~250). The GGUF
holds what a SentencePiece BPE needs: `tokenizer.ggml.tokens`, `scores` (higher = merged
earlier) and `token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte). The rebuild:

- merges: every split of a vocabulary token into two vocabulary tokens, ordered by the merged
  token's score (highest first), as transformers' SentencePieceExtractor does for .model files;
- spaces become `▁` (no prefix space: `add_space_prefix` is false for Gemma), byte fallback
  (`<0x0A>` ...) for characters outside the vocabulary;
- control tokens (`<bos>`, `<eos>`, ...) and user-defined ones are added tokens, never split;
- `add_bos_token` from the GGUF: encoding prepends `<bos>`.
"""
from __future__ import annotations

from pathlib import Path

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _field(reader, name, default=None):
    f = reader.fields.get(name)
    if f is None:
        return default
    return f.contents()


def read_vocab(gguf_path: str | Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(gguf_path))
    model = _field(r, "tokenizer.ggml.model")
    if model != "llama":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {model!r}; only SentencePiece ('llama') "
                         f"vocabularies are rebuilt here")
    return {
        "tokens": list(_field(r, "tokenizer.ggml.tokens")),
        "scores": [float(x) for x in _field(r, "tokenizer.ggml.scores")],
        "types": [int(x) for x in _field(r, "tokenizer.ggml.token_type")],
        "bos": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos": _field(r, "tokenizer.ggml.eos_token_id"),
        "unk": _field(r, "tokenizer.ggml.unknown_token_id"),
        "pad": _field(r, "tokenizer.ggml.padding_token_id"),
        "add_bos": bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        "add_space_prefix": bool(_field(r, "tokenizer.ggml.add_space_prefix", False)),
    }


def bpe_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """(left, right) pairs whose concatenation is a normal token, by that token's score, best first."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, UNUSED)}
    found = []
    for merged, i in vocab.items():
        for cut in range(1, len(merged)):
            left, right = merged[:cut], merged[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[4], f[5]) for f in found]


def build(gguf_path: str | Path):
    """A `tokenizers.Tokenizer` equivalent to the GGUF's SentencePiece BPE."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    v = read_vocab(gguf_path)
    tokens, types = v["tokens"], v["types"]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[v["unk"]] if v["unk"] is not None else None
    tok = Tokenizer(BPE(vocab=vocab, merges=bpe_merges(tokens, v["scores"], types), unk_token=unk,
                        fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if v["add_space_prefix"] else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if v["add_space_prefix"] else []))
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if v["add_bos"] and v["bos"] is not None:
        bos = tokens[v["bos"]]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, v["bos"])])
    return tok


def write_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write tokenizer.json rebuilt from the GGUF into `out_dir` (replacing transformers' conversion)."""
    path = Path(out_dir) / "tokenizer.json"
    build(gguf_path).save(str(path))
    return path
