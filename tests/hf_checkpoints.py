"""Tiny random checkpoints that transformers itself makes and saves, for the Hugging Face tests."""

import numpy as np


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
