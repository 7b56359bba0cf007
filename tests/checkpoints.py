"""Small open-model checkpoints built here, as a user's would be: a byte-level BPE trained with the
`tokenizers` library, wrapped and saved by transformers with a ChatML chat template, and a random model of a
transformers class saved by `save_pretrained`. No hub: the tests that need them build them in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GENERATION_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with transformers' {% generation %} blocks around the assistant's text and its end of turn."""
DOCS = [
    "Tom saw a big red ball. He was happy and played with it all day.",
    "Lily and Ben went to the park. They saw a dog. The dog was très content!",
    "Once upon a time, there was a little cat named Mia. She liked to nap in the sun.",
]


def chat_tokenizer(
    folder: Path, transformers: Any, bos: bool = True, vocab_size: int = 400, template: str = CHATML
) -> Any:
    """A Llama 3 style tokenizer (byte-level BPE, <|begin_of_text|> put before every text by its
    post-processor when `bos`, end of turn <|im_end|> as eos, a ChatML template), saved in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=IM_END, pad_token=EOS, chat_template=template
    )
    fast.save_pretrained(folder)
    return fast


def chat_checkpoint(
    folder: Path, hf: tuple, arch: str = "LlamaForCausalLM", template: str = CHATML, **config: Any
) -> Any:
    """A random `arch` model (`random_model`) with `chat_tokenizer`'s vocabulary, saved with its tokenizer in
    `folder`; eos ids <|im_end|> and <|end_of_text|>. Returns the transformers model."""
    tok = chat_tokenizer(folder, hf[1], template=template)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (BOS, EOS, IM_END)}
    ends = dict(bos_token_id=ids[BOS], eos_token_id=[ids[IM_END], ids[EOS]], pad_token_id=ids[EOS])
    return random_model(folder, hf, arch, **{"vocab_size": len(tok), **ends, **config})


def random_model(folder: Path, hf: tuple, arch: str, **config: Any) -> Any:
    """A small random `arch` model (of `config`'s vocab_size), its norms and biases perturbed so they matter,
    saved in `folder`."""
    torch, transformers = hf
    settings = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    settings.update(config)
    config_class = arch.replace("ForCausalLM", "Config").replace("LMHeadModel", "Config")
    model_config = getattr(transformers, config_class)(**settings)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(model_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def conversations(
    n: int, seed: int = 0, names: tuple[str, ...] = ("Tom", "Lily", "Ben", "Mia")
) -> list[dict]:
    """`n` small conversations in TRL's "messages" format: one or two turns, some with a system message."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        name, place = rng.choice(names), rng.choice(["park", "sun", "ball", "dog"])
        messages = [
            {"role": "user", "content": f"What did {name} like?"},
            {"role": "assistant", "content": f"{name} liked the {place}. It was happy."},
        ]
        if i % 3 == 0:
            messages = [{"role": "system", "content": "Be brief."}, *messages]
            messages += [
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "They played."},
            ]
        out.append({"messages": messages})
    return out


SPACE = "\u2581"
LLAMA2_CHAT = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + ' ' + eos_token }}{% else %}"
    "{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}{% endif %}{% endfor %}"
)
"""A Llama 2 style chat template: [INST] turns, each conversation's user turns after the BOS."""


def spm_tokenizer(folder: Path, transformers: Any, scheme: str = "always", vocab_size: int = 300) -> Any:
    """A SentencePiece-style tokenizer as Llama 2's and Mistral's tokenizer.json are (BPE over ▁-pieces with
    <0xNN> byte fallback, <unk> <s> </s>, a BOS before every text, a Llama 2 chat template), saved in
    `folder`. Its dummy prefix: "always" by a Prepend normalizer as in Llama 2's file (before every stretch
    between special tokens), or "first" by a Metaspace pre-tokenizer (before the start only)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always")
    learner.train_from_iterator(DOCS * 20, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    pieces = sorted(learned["vocab"], key=learned["vocab"].get)
    vocab = {t: i for i, t in enumerate([*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(specials)
    bytes_back = [decoders.ByteFallback(), decoders.Fuse()]
    if scheme == "always":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPACE, " "), *bytes_back, decoders.Strip(" ", 1, 0)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme=scheme, split=False)
        tok.decoder = decoders.Sequence([decoders.Metaspace(SPACE, prepend_scheme=scheme), *bytes_back])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=LLAMA2_CHAT
    )
    fast.save_pretrained(folder)
    return fast


def spm_checkpoint(folder: Path, hf: tuple, scheme: str = "always") -> Any:
    """A random Llama model with `spm_tokenizer`'s vocabulary (BOS <s>, eos </s>), saved with it in `folder`."""
    tok = spm_tokenizer(folder, hf[1], scheme)
    ends = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return random_model(folder, hf, "LlamaForCausalLM", vocab_size=len(tok), **ends)
