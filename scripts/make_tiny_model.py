"""Write the tiny random-weight model the CPU engines and tests use: kairos_ray/models/tiny-llama/.

A 2-layer LlamaForCausalLM (hidden 128, 4 heads, 2 KV heads, vocab 1024): only its config and a byte-level
BPE tokenizer are shipped; vLLM makes the weights with load_format="dummy" (deterministic for a seed).
The tokenizer is trained here on a fixed built-in corpus, so rerunning this script rewrites the same files.

    .venv/bin/python scripts/make_tiny_model.py
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = Path(__file__).resolve().parents[1] / "kairos_ray" / "models" / "tiny-llama"
VOCAB = 1024
SPECIAL = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2

CORPUS = """
Disaggregated serving runs prefill and decode on separate GPU pools. Under bursty, heavy-tailed traffic the
prefill pool saturates while decode GPUs idle, and most of the tail time to first token is queueing plus
KV-cache transfer. Kairos lets decode nodes take over the prefill of chosen requests as chunked-prefill steps
interleaved with their decode batch, so the KV is built in place and nothing is transferred. Per request, a
central router estimates the time to first token on the prefill path and, for each decode node, builds the
largest safe shrinking chunk schedule from a fitted step-latency model, and deflects only when that is
clearly faster. The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine,
thank you. What is the weather like? It is sunny and warm, with a light breeze from the west. Numbers: 0 1 2
3 4 5 6 7 8 9 10 100 1000. Code: def f(x): return x * 2 + 1; for i in range(10): print(i).
"""

CHAT_TEMPLATE = (  # tools and documents are rendered, as most real models' templates do
    "{% if tools %}<s>tools: {{ tools | tojson }}\n{% endif %}"
    "{% if documents %}<s>documents: {{ documents | tojson }}\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([line for line in CORPUS.splitlines() if line] * 20, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    tokenizer.save(str(OUT / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (OUT / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    print(f"wrote {OUT} (vocab {tokenizer.get_vocab_size()})")


if __name__ == "__main__":
    main()
