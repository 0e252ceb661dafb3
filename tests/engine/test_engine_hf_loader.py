"""Loading a Hugging Face safetensors directory (config.json, tokenizer.json,
tokenizer_config.json): the same weights give the same tokens as the source model."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.factory import LoadedModel, build_llm_engine, load_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _write_checkpoint(loaded: LoadedModel, path: Path) -> None:
    state = {
        k: v.contiguous()
        for k, v in loaded.model.checkpoint_state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(state, str(path / "model.safetensors"))
    cfg = {**loaded.config.to_hf_dict(), "model_type": "llama", "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({c: i + len(SPECIALS) for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    tc = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(tc))


def test_safetensors_dir_loads_and_generates_like_its_source(
    tiny_model: LoadedModel, tmp_path: Path
) -> None:
    _write_checkpoint(tiny_model, tmp_path)
    loaded = load_model(EngineConfig(model=str(tmp_path), dtype="float32"))
    assert loaded.config.num_key_value_heads == tiny_model.config.num_key_value_heads
    assert loaded.tokenizer.eos_token_ids == (2,)
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert ids[0] == 1 and ids[-2:] == [2, loaded.tokenizer.encode("\n")[0]]
    assert loaded.tokenizer.decode(ids) == "user\nhéllo\n"
    prompt = tuple(loaded.tokenizer.encode("The quick brown fox"))
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for lm in (loaded, tiny_model):
        engine = build_llm_engine(EngineConfig.tiny(), lm)
        chunks = engine.generate_sync([GenerationRequest("r", prompt, p)])["r"][0]
        outs.append([t for c in chunks for t in c.token_ids])
    assert outs[0] == outs[1]
