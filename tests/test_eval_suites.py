import json
from collections import Counter

import pytest

from specdraft.errors import SpecdraftError
from specdraft.eval.suites import HELD_OUT_ROWS, load_prompt_file, load_prompts


def test_mtbench_has_eight_categories_of_ten():
    prompts = load_prompts("mtbench")
    assert Counter(p.domain for p in prompts) == dict.fromkeys(
        ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"], 10
    )
    assert all(p.messages[-1]["role"] == "user" and p.messages[-1]["content"] for p in prompts)


def test_humaneval_prompts_contain_the_function_stub():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert "def " in prompts[0].messages[0]["content"]


@pytest.mark.slow
def test_translation_prompts_come_from_held_out_rows():
    prompts = load_prompts("translation")
    assert len(prompts) == 24
    assert all(p.messages[0]["content"].startswith("Translate the following text into ") for p in prompts)
    assert HELD_OUT_ROWS >= 1000


def test_limit_per_domain_caps_each_domain():
    prompts = load_prompts("mtbench", limit_per_domain=2)
    assert set(Counter(p.domain for p in prompts).values()) == {2}


def test_prompt_file_accepts_prompt_and_messages(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        json.dumps({"prompt": "hi", "domain": "chat"})
        + "\n"
        + json.dumps({"id": "x", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
        + "\n"
    )
    prompts = load_prompt_file(path)
    assert [p.domain for p in prompts] == ["chat", "custom"]
    assert prompts[1].prompt_id == "x" and len(prompts[1].messages) == 2


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "holds no prompts"),
        ('{"prompt": ""}\n', "needs a non-empty 'prompt'"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n', "must end with a user turn"),
        ("not json\n", "invalid JSON"),
    ],
)
def test_bad_prompt_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(SpecdraftError, match=message) as info:
        load_prompt_file(path)
    if content:
        assert "bad.jsonl" in str(info.value)


def test_missing_prompt_file_and_suite_choice():
    with pytest.raises(SpecdraftError, match="does not exist"):
        load_prompt_file("/nonexistent/prompts.jsonl")
    with pytest.raises(SpecdraftError, match="exactly one"):
        load_prompts(None, None)
    with pytest.raises(SpecdraftError, match="unknown prompt suite"):
        load_prompts("nope")


def test_math_suite_is_mtbench_math_plus_held_out_word_problems():
    from specdraft.eval.suites import SUITES

    prompts = SUITES.get("math")()
    assert {p.domain for p in prompts} == {"math"}
    mt = [p for p in prompts if p.prompt_id.startswith("mtbench-")]
    words = [p for p in prompts if p.prompt_id.startswith("word-problem-")]
    assert len(mt) == 10 and len(words) >= 3 and len(mt) + len(words) == len(prompts)
    for p in words:
        text = p.messages[-1]["content"]
        assert "?" in text and sum(c.isdigit() for c in text) >= 2 and "```" not in text
    domains = {p.domain for p in SUITES.get("domains")()}
    assert {"math", "math-word", "code", "translation", "writing"} <= domains
