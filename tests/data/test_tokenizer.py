"""Tokenizer wrapper: tokenizer.json round trip, special/stop ids from the config files, chat-template
rendering (hand-written expectation and, when installed, transformers as an independent reference)."""

import json
import string

import pytest

from jaxrl_fp8.data.builtin_tokenizer import BOS_ID, CHARS, EOS_ID, PAD_ID, builtin_tokenizer
from jaxrl_fp8.data.chat_template import ChatTemplateError, render_chat_template, select_chat_template
from jaxrl_fp8.data.tokenizer import load_tokenizer

# A ChatML-style template written for this test (Jinja features HF templates use: loops, raise_exception,
# trim_blocks / lstrip_blocks whitespace rules, a `generation` block, an optional kwarg).
TEMPLATE = (
    "{% for m in messages %}\n"
    "    {% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}\n"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n"
    "<think>\n\n</think>\n\n"
    "{% endif %}\n"
    "{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
EXPECTED = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
            "<|im_start|>assistant\n")


def _chat_tokenizer_dir(tmp_path, config_extra=None):
    """A character-level tokenizer.json with ChatML specials, plus HF-style config files."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for c in string.printable:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    (tmp_path / "tokenizer.json").write_text(tok.to_str())
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>",
              "bos_token": None, "chat_template": TEMPLATE}
    config.update(config_extra or {})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tmp_path


def test_builtin_round_trip_and_ids():
    tok = builtin_tokenizer()
    assert tok.vocab_size == 4 + len(CHARS) == 24
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.stop_ids) == (PAD_ID, BOS_ID, EOS_ID, (EOS_ID,))
    ids = tok.encode("12+34=", add_special_tokens=True)
    assert ids[0] == BOS_ID and len(ids) == 7
    assert tok.decode(ids) == "12+34="
    assert tok.decode(ids + [EOS_ID, PAD_ID]) == "12+34="
    for text in ["0", "9876543210", "1, 2 | 3:4 <> -*"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode_prompt("37=") == ("37=", [BOS_ID] + tok.encode("37="))
    # deterministic: two builds give the same tokenizer.json
    assert builtin_tokenizer().tokenizer.to_str() == tok.tokenizer.to_str()


def test_save_and_load_round_trip(tmp_path):
    tok = builtin_tokenizer()
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("5+5=", True) == tok.encode("5+5=", True)
    assert (loaded.eos_id, loaded.pad_id, loaded.bos_id) == (tok.eos_id, tok.pad_id, tok.bos_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_hf_style_directory(tmp_path):
    tok = load_tokenizer(_chat_tokenizer_dir(tmp_path))
    assert tok.eos_id == 2 and tok.pad_id == 0 and tok.bos_id is None
    assert tok.stop_ids == (2, 0)  # eos first, then generation_config's others
    text = tok.apply_chat_template(MESSAGES)
    assert text == EXPECTED
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    rendered, ids = tok.encode_prompt(MESSAGES)
    assert rendered == EXPECTED and ids[0] == tok.token_to_id("<|im_start|>")
    # a plain-string prompt goes through the template as one user message when a template exists
    assert tok.render_prompt("hi") == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True)
    assert tok.render_prompt("hi", use_chat_template=False) == ("hi", False)
    with pytest.raises(ChatTemplateError, match="needs the chat template"):
        tok.render_prompt(MESSAGES, use_chat_template=False)


def test_template_kwargs_and_no_generation_prompt(tmp_path):
    tok = load_tokenizer(_chat_tokenizer_dir(tmp_path))
    assert tok.apply_chat_template(MESSAGES, enable_thinking=False) == EXPECTED + "<think>\n\n</think>\n\n"
    convo = MESSAGES + [{"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(convo, add_generation_prompt=False) == \
        EXPECTED + "4<|im_end|>\n"


def test_template_errors(tmp_path):
    tok = load_tokenizer(_chat_tokenizer_dir(tmp_path))
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for x in %}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        builtin_tokenizer().apply_chat_template(MESSAGES)


def test_template_is_sandboxed():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}", MESSAGES)


def test_named_template_list_and_chat_template_jinja_file(tmp_path):
    assert select_chat_template([{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]) == "A"
    with pytest.raises(ChatTemplateError, match="no template named"):
        select_chat_template([{"name": "tool_use", "template": "B"}])
    d = _chat_tokenizer_dir(tmp_path, {"chat_template": None})
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert load_tokenizer(d).apply_chat_template(MESSAGES) == "Be brief.!"


def test_bad_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "cfg").mkdir()
    d = _chat_tokenizer_dir(tmp_path / "cfg", {"eos_token": "<|nope|>"})
    with pytest.raises(ValueError, match="eos_token='<|nope|>' is not in the vocabulary"):
        load_tokenizer(d)


def test_rendering_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = _chat_tokenizer_dir(tmp_path)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), chat_template=TEMPLATE,
                                              eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ours = load_tokenizer(d)
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(MESSAGES, **kwargs) == expected
    convo = MESSAGES + [{"role": "assistant", "content": "4"}]
    assert ours.apply_chat_template(convo, add_generation_prompt=False) == hf.apply_chat_template(
        convo, tokenize=False, add_generation_prompt=False)
