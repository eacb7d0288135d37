"""Chat templates (`io.chat`): token ids equal `transformers`' `apply_chat_template` for
SmolLM2's template (from its GGUF file) and for a Qwen3-style and a Gemma-style template
saved with a tokenizer; a template that fails, escapes the sandbox or is absent is
refused in one line; `generate --chat` runs end to end."""

import json
import pathlib

import pytest

from jax_specdec.cli import main
from jax_specdec.io import zoo
from jax_specdec.io.chat import ChatTemplate, encode_chat, load_chat_template
from jax_specdec.io.hf import load_tokenizer

transformers = pytest.importorskip("transformers")

PAIR = pathlib.Path(__file__).resolve().parents[1] / "models"

# Written here in the manner of Qwen3's template: ChatML turns, a namespace walked in
# reverse to find the last user query, reasoning kept only after it, tool results
# folded into a user turn, an empty think block when thinking is off.
QWEN3_STYLE = """\
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query == messages|length - 1 %}
        {%- set ns.last_query = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role in ["system", "user"] %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- else %}
            {%- set reasoning = '' %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content | tojson }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception("unknown role " + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Written here in the manner of Gemma's: a BOS token, the system message merged into the
# first user turn, roles that must alternate, "model" for the assistant.
GEMMA_STYLE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that reverses a list."}],
    [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nfour"},
        {"role": "user", "content": 'And 3 + 3? "quoted" <b>'},
    ],
]


def _hf_ids(tokenizer, messages, **kwargs):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _saved_tokenizer(tmp_path, template, **special):
    """A `transformers` tokenizer (the shipped pair's BPE) with `template`, saved."""
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(PAIR / "stdlib-target" / "tokenizer.json"), **special
    )
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    return transformers.AutoTokenizer.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "template, special",
    [
        (QWEN3_STYLE, dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
        (GEMMA_STYLE, dict(bos_token="<bos>", eos_token="<eos>")),
    ],
    ids=["qwen3-style", "gemma-style"],
)
def test_templates_saved_with_a_tokenizer_give_transformers_ids(tmp_path, template, special):
    theirs = _saved_tokenizer(tmp_path, template, **special)
    ours, chat = load_tokenizer(tmp_path), load_chat_template(tmp_path)
    assert chat is not None and "chat_template" in chat.source
    for messages in CONVERSATIONS:
        expected = _hf_ids(theirs, messages)
        assert encode_chat(ours, chat, messages) == expected
        assert len(expected) > 10


@pytest.mark.slow  # the real model's template; the quick loop renders two saved ones
def test_smollm2_template_from_its_gguf_gives_transformers_ids():
    # Texts are compared whole; ids where the two GGUF tokenizers agree: ours splits
    # digits first, as SmolLM2's own tokenizer.json does, transformers' GGUF conversion
    # does not ("\n\n4" is one piece there), so no digit follows whitespace here.
    try:
        path = zoo.model_path("smollm2-135m", progress=False)
    except zoo.DownloadError as e:
        pytest.skip(f"SmolLM2 download failed: {e}")
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ours, chat = load_tokenizer(path), load_chat_template(path)
    assert chat.source.endswith("tokenizer.chat_template")
    for messages in CONVERSATIONS:
        text = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert chat.render(messages) == text
        assert encode_chat(ours, chat, messages) == _hf_ids(theirs, messages)


def test_a_template_that_fails_names_the_file_and_field(tmp_path):
    _saved_tokenizer(tmp_path, GEMMA_STYLE, bos_token="<bos>")
    chat = load_chat_template(tmp_path)
    bad = [{"role": "assistant", "content": "hi"}]
    with pytest.raises(ValueError, match="chat_template.jinja: the chat template fails: .*alter"):
        chat.render(bad)
    broken = ChatTemplate("{% for m in messages %}", "dir/tokenizer_config.json: chat_template")
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_template: the chat templ"):
        broken.render(CONVERSATIONS[0])


def test_the_sandbox_refuses_what_a_template_must_not_reach():
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "t: chat_template")
    with pytest.raises(ValueError, match="t: chat_template: the chat template fails"):
        escape.render(CONVERSATIONS[0])
    private = ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns }}", "t: chat_template")
    with pytest.raises(ValueError, match="cannot hold '_x'"):
        private.render(CONVERSATIONS[0])


def test_messages_are_checked_field_by_field():
    chat = ChatTemplate("{{ messages }}", "t")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content must be a string"):
        chat.render([{"role": "user"}])
    with pytest.raises(ValueError, match="non-empty list"):
        chat.render([])


def test_named_templates_and_jinja_files(tmp_path):
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(tmp_path).template == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path).template == "J"
    assert load_chat_template(PAIR / "stdlib-target") is None


@pytest.mark.slow
def test_generate_chat_end_to_end_and_refused_without_a_template(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--chat", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert "--chat: " in err and "stdlib-target has no chat template" in err
    assert err.count("\n") == 1
    model = _model_with_template(tmp_path)
    argv = ["generate", "x = 1", "--target", str(model), "--draft", "ngram", "--json", "-k", "4"]
    assert main([*argv, "--chat", "--max-new-tokens", "4"]) == 0
    chat = json.loads(capsys.readouterr().out)["outputs"][0]
    assert main([*argv, "--max-new-tokens", "4"]) == 0
    plain = json.loads(capsys.readouterr().out)["outputs"][0]
    assert chat["prompt"] == plain["prompt"] == "x = 1"
    assert len(chat["tokens"]) == 4 and chat["tokens"] != plain["tokens"]


def _model_with_template(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for f in (PAIR / "stdlib-target").iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    template += "{% if add_generation_prompt %}assistant:{% endif %}"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return model


@pytest.mark.slow
def test_batch_rows_may_carry_messages(tmp_path, capsys):
    model = _model_with_template(tmp_path)
    argv = ["generate", "x = 1", "--target", str(model), "--draft", "ngram", "--json", "-k", "4"]
    assert main([*argv, "--chat", "--max-new-tokens", "5"]) == 0
    chat = json.loads(capsys.readouterr().out)["outputs"][0]["tokens"]
    rows = tmp_path / "in.jsonl"
    message = {"role": "user", "content": "x = 1"}
    rows.write_text(
        json.dumps({"id": "m", "messages": [message]}) + "\n" + '{"id": "p", "prompt": "x = 1"}\n'
    )
    out = tmp_path / "out.jsonl"
    job = ["batch", "--input", str(rows), "--output", str(out), "--max-new-tokens", "5"]
    assert main([*job, "--target", str(model), "--draft", "ngram"]) == 0
    lines = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert lines["m"]["tokens"] == chat and lines["p"]["tokens"] != chat


@pytest.mark.parametrize(
    "messages, words",
    [
        ([{"role": "user"}], "line 1 (id 1): 'messages'[0].content must be a string"),
        ([], "line 1 (id 1): 'messages' must be a non-empty list"),
    ],
)
def test_bad_messages_rows_are_named(tmp_path, capsys, messages, words):
    model = _model_with_template(tmp_path)
    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": 1, "messages": messages}) + "\n")
    job = ["batch", "--input", str(rows), "--output", str(tmp_path / "o.jsonl")]
    with pytest.raises(SystemExit):
        main([*job, "--target", str(model), "--draft", "ngram"])
    assert words in capsys.readouterr().err


def test_messages_without_a_template_are_refused(tmp_path, capsys):
    rows = tmp_path / "in.jsonl"
    rows.write_text('{"id": 7, "messages": [{"role": "user", "content": "hi"}]}\n')
    job = ["batch", "--input", str(rows), "--output", str(tmp_path / "o.jsonl")]
    with pytest.raises(SystemExit):
        main(job)
    err = capsys.readouterr().err
    assert "line 1 (id 7): 'messages' needs a chat template; the target has none" in err
