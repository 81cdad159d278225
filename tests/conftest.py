"""Fixtures: tiny random GPT-2 and Llama checkpoints (seconds to build), exported once per session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GPT2_TOKENIZER = SHARED / "data" / "gpt2-tokenizer"
# A test that reads what a fixed random model writes under GPT-2's own vocabulary (where its
# sentences end, which words are one token) runs where ../shared holds that tokenizer.
GPT2_VOCAB = pytest.mark.skipif(not (GPT2_TOKENIZER / "vocab.json").is_file(),
                                reason="reads a fixed random model's text under the real GPT-2 tokenizer "
                                       "(../shared/data/gpt2-tokenizer), absent here")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/naive.py
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".numba_cache"))
# No test reads the model hub: offline, a hub id fails at once instead of after 20 s of retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two workers on two cores: one thread each for ORT and the kernel (and the processes they start),
# as two ORT sessions of two spinning threads each would take turns on the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("DBS_FAST_THREADS", "1")


def _gpt2_tokenizer(tmp: Path):
    """The real GPT-2 tokenizer when ../shared is present, else a byte-level BPE trained on the
    packaged English (CommonGen's references and the chat requests), large enough that the tests'
    everyday words are single tokens, as they are in GPT-2's."""
    from transformers import GPT2TokenizerFast

    if (GPT2_TOKENIZER / "vocab.json").is_file():
        return GPT2TokenizerFast.from_pretrained(str(GPT2_TOKENIZER))
    return _trained_bpe(tmp, vocab_size=8000, english=True)


def _packaged_english() -> list[str]:
    import json
    from importlib.resources import files

    data = files("dbs_fast").joinpath("data")
    refs = [r for line in data.joinpath("commongen_dev_all_refs.jsonl").read_text(encoding="utf-8").splitlines()
            if line for r in json.loads(line)["references"]]
    tsv = [line.split("\t")[-1] for name in ("commongen_train_pool.tsv", "chat_requests.tsv")
           for line in data.joinpath(name).read_text(encoding="utf-8").splitlines()]
    return refs + tsv


def _trained_bpe(tmp: Path, vocab_size: int = 400, english: bool = False):
    """A byte-level BPE of `vocab_size` tokens, trained on two sentences (and with `english` the
    packaged English)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2TokenizerFast

    text = ("It is a colony of enemies that meet at speed near the mouth of the river. " * 20
            + "The quick brown fox jumps over the lazy dog. Colonies, mouths, meetings. " * 20)
    lines = [text] + (_packaged_english() if english else [])
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"])
    d = tmp / f"bpe{vocab_size}{'-english' if english else ''}"
    d.mkdir(exist_ok=True)
    bpe.save_model(str(d))
    return GPT2TokenizerFast(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt"))


def make_checkpoint(kind: str, out: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = _gpt2_tokenizer(out.parent)
    tok.eos_token = tok.eos_token or "<|endoftext|>"
    V = len(tok)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=V, n_positions=256, n_embd=32, n_layer=2, n_head=4,
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    elif kind == "qwen3":                      # the Llama layer with an RMSNorm on each head's q and k
        from transformers import Qwen3Config, Qwen3ForCausalLM

        cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                          bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():                  # norms that are not the identity, so that parity sees them
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif kind == "smollm3":                    # the Llama layer; every other layer without RoPE (NoPE)
        from transformers import SmolLM3Config, SmolLM3ForCausalLM

        cfg = SmolLM3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            no_rope_layers=[1, 0], bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.eos_token_id)
        model = SmolLM3ForCausalLM(cfg)
    elif kind == "opt":                        # learned positions (offset 2), pre-norm blocks, ReLU MLP
        from transformers import OPTConfig, OPTForCausalLM

        cfg = OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=256, word_embed_proj_dim=32, bos_token_id=tok.eos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        model = OPTForCausalLM(cfg)
    elif kind in ("phi3", "phi4"):             # the Llama layer with fused q/k/v and gate/up projections;
        from transformers import (  # phi4: a rotary over half of each head
            Phi3Config,
            Phi3ForCausalLM,
        )

        cfg = Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         original_max_position_embeddings=256, bos_token_id=tok.eos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, tie_word_embeddings=False,
                         partial_rotary_factor=0.5 if kind == "phi4" else 1.0)
        model = Phi3ForCausalLM(cfg)
    elif kind == "neox":                       # fused per-head q/k/v, a quarter of each head rotated, parallel residual
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        cfg = GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, rotary_pct=0.25, max_position_embeddings=256,
                            use_parallel_residual=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
        model = GPTNeoXForCausalLM(cfg)
    elif kind in ("gemma2", "gemma3"):         # norms around each block; local + global layers; soft-capping (2)
        from transformers import (
            Gemma2Config,
            Gemma2ForCausalLM,
            Gemma3ForCausalLM,
            Gemma3TextConfig,
        )

        common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=256, query_pre_attn_scalar=8,
                      sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        if kind == "gemma2":
            model = Gemma2ForCausalLM(Gemma2Config(**common, attn_logit_softcapping=5.0, final_logit_softcapping=3.0))
        else:
            model = Gemma3ForCausalLM(Gemma3TextConfig(**common, rope_local_base_freq=100.0))
        with torch.no_grad():                  # norms that are not the identity (Gemma's start at 1 + 0)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
    else:
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                          tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("ckpt")
    return {k: make_checkpoint(k, root / k) for k in ("gpt2", "llama")}


@pytest.fixture(scope="session")
def exported(checkpoints, tmp_path_factory):
    from dbs_fast.export.convert import export_model

    root = tmp_path_factory.mktemp("onnx")
    return {k: Path(export_model(str(p), root / k, quiet=True) and root / k) for k, p in checkpoints.items()}


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def chat_model_dir(exported, tmp_path_factory):
    """The tiny GPT-2 export with a chat template, as an Instruct model's export carries one."""
    import shutil

    d = tmp_path_factory.mktemp("chat") / "gpt2"
    shutil.copytree(exported["gpt2"], d)
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


def pytest_collection_modifyitems(config, items):
    """The slow tier first (stable within each tier), so that two workers end on short tests
    together instead of one waiting on the other's long test at the end."""
    items.sort(key=lambda item: item.get_closest_marker("integration") is None)
