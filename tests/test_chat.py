"""Chat templates render as Hugging Face's ``apply_chat_template`` renders them, and the
assistant's turns are found in the text (the characters SFT trains on).

The templates are written here in the styles of three model families (Llama 3's headers, Qwen's
ChatML, Mistral's [INST]); none is copied from a checkpoint.
"""

import json

import pytest

from shardax.data.chat import ChatTemplate
from shardax.errors import UsageError

HEADERS = (  # Llama 3's style: a header per turn, each turn closed by <|eot_id|>
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML = (  # Qwen's style, with a default system turn
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INST = (  # Mistral's style: user and assistant alternate, or the template refuses
    "{{ bos_token }}{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('turns must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{% generation %} {{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}{% endfor %}")
TEMPLATES = {"headers": HEADERS, "chatml": CHATML, "inst": INST}
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}
CONVERSATION = [{"role": "user", "content": "Name a prime number."},
                {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "And an even one, in Ελληνικά?"},
                {"role": "assistant", "content": "Δύο (two)."}]


def transformers_render(source, messages, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = source
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("style", list(TEMPLATES))
def test_a_template_renders_as_transformers_renders_it(style, prompt):
    messages = CONVERSATION[:3] if prompt else CONVERSATION
    ours = ChatTemplate(TEMPLATES[style], TOKENS).render(messages, add_generation_prompt=prompt)
    assert ours == transformers_render(TEMPLATES[style], messages, prompt)
    assert "Ελληνικά" in ours


@pytest.mark.parametrize("style, turns", [
    ("headers", ["Seven.<|eot_id|>", "Δύο (two).<|eot_id|>"]),
    ("chatml", ["Seven.<|im_end|>\n", "Δύο (two).<|im_end|>\n"]),
    ("inst", [" Seven.</s>", " Δύο (two).</s>"]),
])
def test_the_assistant_turns_are_what_they_add_after_the_generation_prompt(style, turns):
    text, spans = ChatTemplate(TEMPLATES[style], TOKENS).assistant_spans(CONVERSATION)
    assert [text[start:end] for start, end in spans] == turns


def test_a_template_is_read_from_tokenizer_config_with_its_special_tokens(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": HEADERS, "bos_token": {"content": "<|begin_of_text|>", "lstrip": False}}))
    text = ChatTemplate.from_tokenizer_config(tmp_path).render(CONVERSATION[:1])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
     "the chat template failed to render this conversation (turns must alternate user/assistant)"),
    ([{"role": "robot", "content": "beep"}], "message 0 has role 'robot'; use one of system, user, assistant, tool"),
    ([{"role": "user"}], "message 0 is not {'role': ..., 'content': ...}"),
    ([], "give a non-empty list of {'role': ..., 'content': ...} messages"),
])
def test_bad_conversations_are_one_line(messages, message):
    with pytest.raises(UsageError) as error:
        ChatTemplate(INST, TOKENS).render(messages)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_directory_without_a_template_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="has no chat template"):
        ChatTemplate.from_tokenizer_config(tmp_path)
