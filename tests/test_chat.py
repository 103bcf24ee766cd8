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
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
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
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


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
    ([{"role": "robot", "content": "beep"}],
     "message 0 has role 'robot'; use one of system, user, assistant, tool"),
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


def _chatml_bpe():
    """A byte-level BPE trained here on the ChatML rendering, its turn markers special tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from shardax.data.tokenizer import BPETokenizer

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300,
                                             special_tokens=["<|im_start|>", "<|im_end|>", "<eod>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([ChatTemplate(CHATML, TOKENS).render(CONVERSATION)] * 20, trainer)
    return BPETokenizer(tokenizer, "test", "<eod>")


@pytest.mark.parametrize("tokenizer", ["bpe", "bytes"])
def test_the_tokens_an_example_trains_on_are_the_assistants_or_the_completions(tokenizer, tmp_path):
    """Conversations: exactly the assistant's turns and their end-of-turn tokens are marked (byte-level
    BPE and bytes alike); prompt/completion as text: the completion's; as messages: the completion's
    assistant turn only, not the prompt's."""
    from shardax.data.conversations import supervised_examples
    from shardax.data.tokenizer import ByteTokenizer

    tokens = _chatml_bpe() if tokenizer == "bpe" else ByteTokenizer()
    lines = [{"messages": CONVERSATION}, {"prompt": "2 + 2 =", "completion": " 4"},
             {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\n\n")
    examples = list(supervised_examples(path, tokens, ChatTemplate(CHATML, TOKENS)))
    def decode(ids):  # special tokens kept
        ids = [int(i) for i in ids]
        return (tokens.decode(ids) if tokenizer == "bytes"
                else tokens.tokenizer.decode(ids, skip_special_tokens=False))

    marked = [decode([i for i, m in zip(ids, mask) if m]) for ids, mask in examples]
    assert marked == ["Seven.<|im_end|>\nΔύο (two).<|im_end|>\n", " 4", "Δύο (two).<|im_end|>\n"]
    whole = decode(examples[0][0])
    # nothing added to what the template wrote
    assert whole == ChatTemplate(CHATML, TOKENS).render(CONVERSATION)


@pytest.mark.parametrize("record, message", [
    ("not json", "line 2 is not JSON"),
    ({"text": "hello"}, "line 2 holds text; give 'messages'"),
    ({"prompt": "Hi", "chosen": "a", "rejected": "b"}, "line 2 is a preference pair (chosen, rejected)"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "line 2: the conversation has no assistant turn"),
    ({"messages": [{"role": "bot", "content": "Hi"}]}, "line 2: message 0 has role 'bot'; use one of"),
    ({"prompt": "Hi", "completion": "  "}, "line 2: the completion is empty"),
    ({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": ""}]},
     "line 2: the completion has no assistant turn with text"),
    ({"messages": [{"role": "assistant", "content": "Hi"}]},
     "line 2: the chat template of the test failed to render this conversation (turns must alternate"),
], ids=["json", "neither-form", "preference", "no-assistant", "role", "empty-completion", "empty-reply",
        "render"])
def test_examples_that_cannot_train_are_one_line_naming_file_and_line(record, message, tmp_path):
    from shardax.data.conversations import supervised_examples
    from shardax.data.tokenizer import ByteTokenizer

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + (
        record if isinstance(record, str) else json.dumps(record)) + "\n")
    template = ChatTemplate(INST, TOKENS, "the chat template of the test")
    with pytest.raises(UsageError) as error:
        list(supervised_examples(path, ByteTokenizer(), template))
    assert f"{path} {message}" in str(error.value) and "\n" not in str(error.value)
    from shardax.data.prepare import prepare  # the same from shardax prepare, which writes nothing

    (tmp_path / "inst.jinja").write_text(INST)
    with pytest.raises(UsageError) as error:
        prepare([path], tmp_path / "out", template=str(tmp_path / "inst.jinja"), workers=1,
                show_progress=False)
    message = message.replace("of the test", str(tmp_path / "inst.jinja"))
    assert f"{path} {message}" in str(error.value) and not (tmp_path / "out").exists()


def test_prepared_conversations_keep_each_example_its_mask_and_a_row_of_its_own(tmp_path):
    """``prepare`` on conversations (the built-in set and a prompt/completion line): every example
    once, in the split its text hashes to, with the tokens and mask ``supervised_tokens`` gives;
    rows hold whole examples (a long one cut, and counted) and the batch of a step lands on its
    devices as the rows it names, the same for the same seed."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from shardax.data.chat import BUILT_IN
    from shardax.data.conversations import assistant_text, lay_rows, supervised_tokens
    from shardax.data.examples import ExampleRows, Examples, validation_rows
    from shardax.data.prepare import is_validation, prepare
    from shardax.data.python_chats import conversations
    from shardax.data.tokenizer import ByteTokenizer

    records = conversations()[:60] + [{"prompt": "2 + 2 =", "completion": " 4"}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    done = prepare([path], tmp_path / "out", workers=1, show_progress=False, validation_fraction=0.2)
    assert done.index["kind"] == "conversations" and done.index["chat_template"] == BUILT_IN.where
    expected = {"train": [], "validation": []}
    for number, record in enumerate(records, 1):
        text, spans = assistant_text(record, BUILT_IN, f"line {number}")
        expected["validation" if is_validation(text, 0.2) else "train"].append(
            supervised_tokens(ByteTokenizer(), text, spans))
    splits = done.index["splits"]
    for split, wanted in expected.items():
        examples = Examples(done.root, splits[split]["shards"], "uint16", 257)
        got = [examples.example(i, 1 << 20) for i in range(len(examples))]
        assert (len(got) == len(wanted) > 0
                and splits[split]["trained"] == sum(int(m.sum()) for _, m in wanted))
        for (ids, mask), (want_ids, want_mask) in zip(got, wanted):
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask)
    train = Examples(done.root, splits["train"]["shards"], "uint16", 257)
    rows = ExampleRows(train, 127, 8, seed=3)
    assert sorted(i for row in rows.plan for i in row) == list(range(len(train)))  # each example once
    assert rows.cut == int((train.lengths > 128).sum()) > 0
    assert all(sum(min(int(train.lengths[i]), 128) for i in row) <= 128 for row in rows.plan)
    assert len(rows.plan) < len(train)  # packing shares rows
    mesh = jax.make_mesh((8,), ("data",))
    batch = rows.global_batch(1, NamedSharding(mesh, PartitionSpec("data")))
    named = [rows.plan[int(rows.order[i])] for i in range(8, 16)]
    laid = lay_rows([[train.example(i, 128) for i in row] for row in named], 128)
    for key, value in batch.items():
        for shard in value.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), laid[key][shard.index], err_msg=key)
    again = ExampleRows(train, 127, 8, seed=3).global_batch(1, NamedSharding(mesh, PartitionSpec("data")))
    np.testing.assert_array_equal(np.asarray(again["tokens"]), np.asarray(batch["tokens"]))
    other = ExampleRows(train, 127, 8, seed=4).global_batch(1, NamedSharding(mesh, PartitionSpec("data")))
    assert not np.array_equal(np.asarray(other["tokens"]), np.asarray(batch["tokens"]))
    held = validation_rows(Examples(done.root, splits["validation"]["shards"], "uint16", 257), 127, 8, 4)
    assert (sum(int(b["mask"].sum()) for b in held)
            == sum(int(m[1:128].sum()) for _, m in expected["validation"]))
    parquet = pytest.importorskip("pyarrow.parquet")  # the same conversations from Parquet: the same examples
    parquet.write_table(__import__("pyarrow").Table.from_pylist(records[:-1]), tmp_path / "chats.parquet")
    again = prepare([tmp_path / "chats.parquet"], tmp_path / "parquet", workers=1, show_progress=False,
                    validation_fraction=0.2)

    def held_examples(root, index):
        found = []
        for split in ("train", "validation"):
            examples = Examples(root, index["splits"][split]["shards"], "uint16", 257)
            found += [tuple(map(bytes, examples.example(i, 1 << 20))) for i in range(len(examples))]
        return sorted(found)

    from_parquet, from_lines = held_examples(again.root, again.index), held_examples(done.root, done.index)
    # all but "2 + 2 ="
    assert set(from_parquet) <= set(from_lines) and len(from_parquet) == len(from_lines) - 1


def test_prepared_preference_pairs_keep_both_sides_together(tmp_path):
    """Pairs (messages, as TRL writes them, and strings): each side is the prompt and that
    completion with the completion's tokens marked, both sides in one split; the step's batch
    holds each pair's chosen and rejected rows; a file too small to hash any pair out holds out
    its last whole pair; an empty side is one line naming the file and line."""
    import numpy as np

    from shardax.data.chat import BUILT_IN
    from shardax.data.conversations import preference_texts, supervised_tokens
    from shardax.data.examples import Examples, PairRows, pair_rows
    from shardax.data.prepare import prepare
    from shardax.data.python_chats import preference_pairs
    from shardax.data.tokenizer import ByteTokenizer

    records = preference_pairs()[:30] + [{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    done = prepare([path], tmp_path / "out", workers=1, show_progress=False, validation_fraction=0.2)
    assert done.index["kind"] == "preferences"
    splits = done.index["splits"]
    sides = {}
    for split in ("train", "validation"):
        examples = Examples(done.root, splits[split]["shards"], "uint16", 257)
        for i in range(0, len(examples), 2):
            sides[bytes(examples.example(i, 1 << 20)[0].astype(np.uint8))] = (split, examples, i)
    assert len(sides) == len(records) and {split for split, _, _ in sides.values()} == {"train", "validation"}
    for number, record in enumerate(records, 1):
        (chosen, chosen_spans), (rejected, rejected_spans) = preference_texts(record, BUILT_IN,
                                                                              f"line {number}")
        split, examples, i = sides[chosen.encode()]  # the chosen side names the pair
        for offset, (text, spans) in enumerate(((chosen, chosen_spans), (rejected, rejected_spans))):
            ids, mask = supervised_tokens(ByteTokenizer(), text, spans)
            got_ids, got_mask = examples.example(i + offset, 1 << 20)
            np.testing.assert_array_equal(got_ids, ids)
            np.testing.assert_array_equal(got_mask, mask)
    assert bytes(chosen[-len(" 4"):], "utf-8") == b" 4" and mask.sum() == len(" 5")  # strings: the completion
    train = Examples(done.root, splits["train"]["shards"], "uint16", 257)
    rows = PairRows(train, 95, 4, seed=0)
    named = [int(rows.order[i]) for i in range(4, 8)]
    batch = rows.global_batch(1, jax_sharding())
    expected = pair_rows(train, named, 96)
    for key, value in batch.items():
        np.testing.assert_array_equal(np.asarray(value), expected[key], err_msg=key)
    assert rows.cut == int((train.lengths.reshape(-1, 2) > 96).any(axis=1).sum())
    two = tmp_path / "two.jsonl"  # a fraction too small to hash either pair out: the last one is held out
    two.write_text("".join(json.dumps(record) + "\n" for record in records[:2]))
    held = prepare([two], tmp_path / "two", workers=1, show_progress=False, validation_fraction=1e-9)
    assert [held.index["splits"][split]["documents"] for split in ("train", "validation")] == [2, 2]
    path.write_text(json.dumps(records[0]) + "\n" + json.dumps({**records[1], "rejected": []}) + "\n")
    with pytest.raises(UsageError,
                       match=f"{path} line 2: the rejected completion is empty, so the pair compares"):
        prepare([path], tmp_path / "bad", workers=1, show_progress=False)


def jax_sharding():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(jax.make_mesh((4,), ("data",), devices=jax.devices()[:4]), PartitionSpec("data"))
