"""Tiny random checkpoints that transformers itself makes and saves, for the Hugging Face tests:
the Llama family's four (``ARCHITECTURES``; conftest's ``checkpoints`` fixture makes them once a
session), the tokens they are run on and helpers that read their outputs."""

import jax
import numpy as np


def _transformers():
    import transformers

    return transformers


COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
ARCHITECTURES = {
    # Llama 3: grouped-query attention, RoPE base 500000 with Llama 3's scaling, an untied head
    "llama3": lambda: _transformers().LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    # Mistral: as Llama, no sliding window
    "mistral": lambda: _transformers().MistralConfig(**COMMON, sliding_window=None),
    # Qwen2: biases on q, k and v; tied embeddings; as many key/value heads as query heads (one fused weight)
    "qwen2": lambda: _transformers().Qwen2Config(**{**COMMON, "num_key_value_heads": 4},
                                                 tie_word_embeddings=True),
    # Qwen3: RMSNorm on each head's queries and keys; a head size of its own (32, not 64 / 4)
    "qwen3": lambda: _transformers().Qwen3Config(**COMMON, head_dim=32),
}
TOKENS = np.random.default_rng(0).integers(0, 96, (8, 17))
# supervised fine-tuning examples: 6 to 13 of each row's tokens, a loss mask on about half of them
SFT = [(TOKENS[i, :6 + i], (np.random.default_rng(i).random(6 + i) < 0.5).astype(np.int32)) for i in range(8)]


def hf_loss(logits):
    """Hugging Face's logits' mean next-token cross-entropy on ``TOKENS``."""
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, TOKENS[:, 1:, None], axis=-1).mean()


def logits_of(loaded):
    return np.asarray(jax.jit(lambda model, tokens: model(tokens))(loaded.model(), TOKENS[:, :-1]))


def make_checkpoints(architectures, tmp_path_factory, tokens, **options):
    """Each of ``architectures`` (name -> a transformers config factory) as transformers saves it,
    its weights moved off their initial values (norms and biases too), with its logits on
    ``tokens[:, :-1]``: ``{name: (folder, logits)}``. ``options`` go to ``from_config``."""
    import torch
    import transformers

    made = {}
    torch.manual_seed(0)
    for name, config in architectures.items():
        model = transformers.AutoModelForCausalLM.from_config(config(), **options).eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
            logits = model(torch.tensor(np.asarray(tokens)[:, :-1])).logits.numpy()
        folder = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(folder)
        made[name] = (folder, logits)
    return made
