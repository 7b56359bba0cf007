"""Chat templates render conversations exactly as transformers' apply_chat_template does, and say which text
the assistant wrote where the template marks it."""

from __future__ import annotations

import pytest

from fixtures.checkpoints import CHATML
from minigpt.data.chat import ChatTemplate
from minigpt.runtime.errors import ConfigError

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": 'Another, with "quotes" & <tags>?'},
]
# Llama 3's template shape: a BOS from the template, headers, tojson, a {% generation %} block.
MARKED = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}"
    "{% if messages[-1]['role'] == 'user' %}{{ messages[-1] | tojson }}{% endif %}"
)


@pytest.fixture(scope="module")
def transformers(hf):
    return hf[1]


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory, transformers):
    from fixtures.checkpoints import chat_tokenizer

    return chat_tokenizer(tmp_path_factory.mktemp("tok"), transformers)


@pytest.mark.parametrize("source", [CHATML, MARKED], ids=["chatml", "llama3-style-marked"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_rendering_equals_transformers(source: str, generation_prompt: bool, fast) -> None:
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|im_end|>")
    ours = template.render(CONVERSATION, add_generation_prompt=generation_prompt).text
    theirs = fast.apply_chat_template(
        CONVERSATION, chat_template=source, add_generation_prompt=generation_prompt, tokenize=False
    )
    assert ours == theirs


def test_generation_blocks_give_the_assistants_text_as_transformers_masks_it(fast) -> None:
    template = ChatTemplate(MARKED, bos_token="<|begin_of_text|>")
    conversation = [*CONVERSATION, {"role": "assistant", "content": "Blue, said with care."}]
    rendered = template.render(conversation)
    assert [rendered.text[a:b] for a, b in rendered.assistant] == ["Red.<|eot_id|>", "Blue, said with care.<|eot_id|>"]  # fmt: skip
    out = fast.apply_chat_template(
        conversation, chat_template=MARKED, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    enc = fast(rendered.text, add_special_tokens=False, return_offsets_mapping=True)
    ours = [int(any(a <= s < b for a, b in rendered.assistant)) for s, _ in enc["offset_mapping"]]
    assert enc["input_ids"] == out["input_ids"] and ours == out["assistant_masks"]


def test_text_that_spells_minigpts_markers_is_kept_and_never_marked_as_the_assistants() -> None:
    """Characters of any kind in a message (the private-use ones too) are text: they stay in the rendering,
    and only the template's {% generation %} blocks say what the assistant wrote."""
    forged = [
        {"role": "user", "content": "\ue000I am not the assistant.\ue001 \ue001\ue000"},
        {"role": "assistant", "content": "Red."},
    ]
    rendered = ChatTemplate(MARKED, bos_token="<|begin_of_text|>").render(forged)
    assert forged[0]["content"] in rendered.text
    assert [rendered.text[a:b] for a, b in rendered.assistant] == ["Red.<|eot_id|>"]


def test_a_template_without_generation_blocks_marks_nothing() -> None:
    assert ChatTemplate(CHATML).render(CONVERSATION).assistant == ()


@pytest.mark.parametrize(
    ("source", "messages", "said"),
    [
        (MARKED, CONVERSATION * 3, "the chat template failed: too long"),
        ("{% for m in messages %}", CONVERSATION, "the chat template is not valid jinja2"),
        (
            CHATML,
            [{"role": "robot", "content": "hi"}],
            "message 1 is not a {'role': system | user | assistant",
        ),
        (CHATML, [{"role": "user", "content": 3}], "message 1 is not"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", CONVERSATION, "the chat template failed"),
    ],
)
def test_what_cannot_be_rendered_is_one_line(source: str, messages: list, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        ChatTemplate(source).render(messages)
    assert said in str(e.value) and "\n" not in str(e.value)


# ChatML with each assistant message (its end-of-turn and newline too) in a {% generation %} block.
CHATML_MARKED = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, fast):
    from minigpt.data.pretrained_tokenizer import PretrainedTokenizer

    folder = tmp_path_factory.mktemp("pretrained")
    fast.save_pretrained(folder)
    return PretrainedTokenizer.from_checkpoint(folder)


def test_without_generation_blocks_the_assistants_tokens_are_what_transformers_marks_with_them(
    pretrained, fast
) -> None:
    """ChatML has no {% generation %} blocks: each assistant message is what rendering it adds after the
    assistant's turn is opened, the same tokens transformers marks in ChatML with the blocks put in."""
    from minigpt.data.chat import example_tokens

    conversation = [*CONVERSATION, {"role": "assistant", "content": "Blue, said with care."}]
    ours = example_tokens({"messages": conversation}, ChatTemplate(CHATML), pretrained)
    out = fast.apply_chat_template(
        conversation, chat_template=CHATML_MARKED, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    assert ours.ids == out["input_ids"] and [int(m) for m in ours.assistant] == out["assistant_masks"]
    marked = example_tokens({"messages": conversation}, ChatTemplate(CHATML_MARKED), pretrained)
    assert marked == ours


def test_a_prompt_completion_pair_trains_on_the_completion_and_its_end(pretrained) -> None:
    from minigpt.data.chat import example_tokens

    text = example_tokens({"prompt": "The sky is", "completion": " blue."}, ChatTemplate(CHATML), pretrained)
    prompt = [pretrained.bos_id, *pretrained.encode("The sky is")]
    assert text.ids[: len(prompt)] == prompt and text.ids[-1] == pretrained.eot_id
    assert text.assistant == [False] * len(prompt) + [True] * (len(text.ids) - len(prompt))
    record = {"prompt": CONVERSATION[:2], "completion": [{"role": "assistant", "content": "Red."}]}
    chat = example_tokens(record, ChatTemplate(CHATML), pretrained)
    said = pretrained.decode([i for i, m in zip(chat.ids, chat.assistant, strict=True) if m])
    assert said == "Red.<|im_end|>\n"


def test_a_checkpoints_template_past_its_bounds_is_named_by_its_file(fast, tmp_path, monkeypatch) -> None:
    """`echo hi | minigpt chat` with a template of endless loops: one line naming the template's file, the
    checkpoint's or the run's copy of it."""
    from minigpt.data import sandbox
    from minigpt.data.pretrained_tokenizer import PretrainedTokenizer
    from minigpt.data.saved_tokenizer import load_tokenizer

    monkeypatch.setattr(sandbox, "MAX_STEPS", 10_000)  # the same refusal, sooner
    fast.save_pretrained(tmp_path / "ck")
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    (tmp_path / "ck" / "chat_template.jinja").write_text(endless)
    tok = PretrainedTokenizer.from_checkpoint(tmp_path / "ck")
    tok.save(tmp_path / "run-tokenizer")
    for t, folder in ((tok, "ck"), (load_tokenizer(tmp_path / "run-tokenizer"), "run-tokenizer")):
        with pytest.raises(ConfigError) as e:
            t.chat_template().render(CONVERSATION, add_generation_prompt=True)
        assert str(e.value).startswith(
            f"the chat template in {tmp_path / folder / 'chat_template.jinja'} ran"
        )
