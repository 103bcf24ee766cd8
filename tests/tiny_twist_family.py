"""A Hugging Face family shardax does not ship, added the way a user adds one: this one file.

``tiny_twist`` is Llama with two twists: its tensors live under ``decoder.`` where Llama's live
under ``model.``, and a ``config.json`` silent on ``rope_theta`` means 500000 (what its
transformers class would assume). Importing the module registers it.
"""

from shardax.hf import register_family
from shardax.hf.families.llama import Llama


class TinyTwist(Llama):
    model_type = "tiny_twist"
    architecture = "TinyTwistForCausalLM"
    defaults = {"rope_theta": 500000.0}

    def tensor_name(self, name):
        return "decoder." + name[len("model."):] if name.startswith("model.") else name


register_family(TinyTwist())
