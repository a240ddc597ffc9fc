"""Tiny Hugging Face configs shared by the model and command-line tests (random weights, nothing downloaded), and
a model folder whose config names code of its own, for the checks that such code runs only when trusted."""

from __future__ import annotations

import json
from pathlib import Path

SEQ = 16
"""Tokens per sequence in the tiny steps captured from these configs."""
LLAMA = dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
"""A two-layer LLaMA's config.json fields."""

# One tiny config of each task beyond causal LMs, by model type: (sizes, the task capture_hf takes it as, the model
# class that task builds). Dropout is kept at each config's default (BERT and T5 train with 0.1).
TASK_ARCHITECTURES = {
    "bert": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=64, vocab_size=128), "masked-lm", "BertForMaskedLM"),
    "t5": (dict(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, vocab_size=128,
                decoder_start_token_id=0), "seq2seq-lm", "T5ForConditionalGeneration"),
    "bart": (dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                  decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2), "seq2seq-lm",
             "BartForConditionalGeneration"),
    "vit": (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                 patch_size=8, num_labels=5), "image-classification", "ViTForImageClassification"),
    "whisper": (dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                     max_source_positions=16, max_target_positions=32, vocab_size=128, decoder_start_token_id=1,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2), "speech-seq2seq",
                "WhisperForConditionalGeneration"),
}


# Imported, it leaves a marker beside itself: proof that the folder's code ran.
EVIL = '''import pathlib
pathlib.Path(__file__).resolve().parent.joinpath("MARKER").write_text("ran")
pathlib.Path({folder!r}).joinpath("MARKER").write_text("ran")
from transformers import LlamaForCausalLM


class EvilForCausalLM(LlamaForCausalLM):
    pass
'''


def remote_code_folder(tmp_path: Path) -> Path:
    """A model folder under ``tmp_path`` whose config.json names code of its own (``auto_map``), which leaves
    MARKER files when it runs."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "auto_map": {
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}))
    (folder / "modeling_evil.py").write_text(EVIL.format(folder=str(folder)))
    return folder
