"""Prompt suites: the built-in one (English and Chinese, short/medium/long) or a user file.

The built-in prompts are deterministic text of roughly known size; their exact token counts are *measured*
with each engine's own tokenizer when the bench starts (``engines.count_prompt_tokens``), never assumed.
A user suite is JSONL (one ``{"messages": [...]}`` or ``{"prompt": "..."}`` per line, optional ``"id"`` and
``"length"``: short|medium|long) or a ShareGPT-style JSON list (``conversations`` with ``from``/``value``; the
turns up to the first human turn are the prompt). Prompts without a length class are binned by size into terciles.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LENGTHS: tuple[str, ...] = ("short", "medium", "long")
#: every length class, shortest first; the token-sized ones run only where the engines' context holds them
ORDER: tuple[str, ...] = ("short", "medium", "long", "4k", "16k", "32k")

#: approximate prompt sizes in tokens; the real counts are measured per engine at bench start
TARGET_TOKENS: dict[str, int] = {"short": 32, "medium": 256, "long": 1024, "4k": 4096, "16k": 16384, "32k": 32768}
SHARED_PREFIX = "shared-prefix"
#: rough characters per token, only to size the generated text
_CHARS_PER_TOKEN = {"en": 4.0, "zh": 1.3}


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    lang: str  # en | zh | other
    length: str  # short | medium | long
    messages: tuple[dict[str, str], ...]


_EN = (
    "The harbour town woke slowly. Fishing boats came in before sunrise, their decks stacked with crates of "
    "silver herring, and the market hall filled with the noise of people bargaining over the catch. ",
    "A railway engineer explained that a bridge is never finished: steel expands in summer, contracts in "
    "winter, and every joint must be inspected for cracks that grow a fraction of a millimetre each year. ",
    "In the library, a student compared three translations of the same poem and noticed that each "
    "translator had chosen a different word for the colour of the sea: grey, green, and simply dark. ",
    "Weather stations on the mountain record wind speed every ten seconds. The data travels down a copper "
    "line to the valley, where an old computer writes it to tape, as it has done for forty years. ",
    "The bakery on the corner sells rye bread with caraway seeds. Its owner says the secret is patience: "
    "the dough rests overnight in a cool room, and nobody is allowed to open the door before six. ",
    "A software team measured their service under load and found that the slowest requests were not the "
    "largest ones but the ones that arrived just after a cache had been cleared. ",
)
_ZH = (
    "清晨的港口小镇慢慢醒来。渔船在日出前靠岸，甲板上堆满了装着银色鲱鱼的木箱，市场里挤满了讨价还价的人。",
    "一位铁路工程师解释说，桥梁永远不会真正完工：钢材夏天膨胀，冬天收缩，每一个接头都必须检查是否有细小的裂缝。",
    "在图书馆里，一个学生比较了同一首诗的三种译本，发现每位译者为大海的颜色选择了不同的词：灰色、绿色，或者只是深色。",
    "山上的气象站每十秒记录一次风速。数据沿着铜线传到山谷，一台旧电脑把它写到磁带上，四十年来一直如此。",
    "街角的面包店出售加了葛缕子籽的黑麦面包。店主说秘诀是耐心：面团在凉爽的房间里静置一夜，六点之前谁也不许开门。",
    "一个软件团队在压力下测量他们的服务，发现最慢的请求不是最大的请求，而是缓存刚被清空之后到达的那些请求。",
)
_ASK = {
    "en": "Read the notes above and continue the story in plain English.",
    "zh": "请阅读上面的笔记，然后用中文继续讲这个故事。",
}
_SHORT = {
    "en": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "zh": "写一个关于灯塔看守人在海边发现漂流瓶的短故事。",
}


def _body(lang: str, tokens: int) -> str:
    paragraphs = _EN if lang == "en" else _ZH
    budget = int(tokens * _CHARS_PER_TOKEN[lang])
    out: list[str] = []
    size = 0
    i = 0
    while size < budget:
        p = paragraphs[i % len(paragraphs)]
        out.append(p)
        size += len(p)
        i += 1
    return "".join(out)


def length_rank(length: str) -> int:
    return ORDER.index(length) if length in ORDER else len(ORDER)


def builtin(lengths: Sequence[str] = LENGTHS) -> list[Prompt]:
    prompts: list[Prompt] = []
    for length in lengths:
        if length not in TARGET_TOKENS:
            raise ValueError(f"unknown prompt length {length!r}; choose from {', '.join(ORDER)}")
        for lang in ("en", "zh"):
            text = _SHORT[lang] if length == "short" else _body(lang, TARGET_TOKENS[length]) + "\n\n" + _ASK[lang]
            prompts.append(Prompt(f"{lang}-{length}", lang, length, ({"role": "user", "content": text},)))
    return prompts


def load_file(path: str | Path, lengths: Sequence[str] = LENGTHS) -> list[Prompt]:
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    raw: list[tuple[str | None, str | None, tuple[dict[str, str], ...]]] = []
    stripped = text.lstrip()
    if stripped.startswith("["):
        for i, item in enumerate(json.loads(text)):
            msgs = _sharegpt(item)
            if msgs:
                raw.append((str(item.get("id", i)) if isinstance(item, dict) else str(i), None, msgs))
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{lineno}: not JSON: {exc}") from exc
            msgs = _messages(obj)
            if not msgs:
                raise ValueError(f"{p}:{lineno}: needs 'messages' or 'prompt'")
            length = obj.get("length") if isinstance(obj.get("length"), str) else None
            raw.append((str(obj.get("id", lineno)), length, msgs))
    if not raw:
        raise ValueError(f"{p}: no prompts")
    sizes = sorted(sum(len(m["content"]) for m in msgs) for _, _, msgs in raw)
    lo, hi = sizes[len(sizes) // 3], sizes[(2 * len(sizes)) // 3]
    out: list[Prompt] = []
    for pid, length, msgs in raw:
        if length not in ORDER:
            size = sum(len(m["content"]) for m in msgs)
            length = "short" if size < lo else "medium" if size < hi or lo == hi else "long"
        content = "".join(m["content"] for m in msgs)
        lang = "zh" if any("\u4e00" <= ch <= "\u9fff" for ch in content[:200]) else "en"
        out.append(Prompt(f"u{pid}", lang, length, msgs))
    wanted = [q for q in out if q.length in lengths]
    return wanted or out


def _messages(obj: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(obj, dict):
        return ()
    if isinstance(obj.get("messages"), list):
        return tuple(
            {"role": str(m.get("role", "user")), "content": str(m.get("content", ""))}
            for m in obj["messages"]
            if isinstance(m, dict)
        )
    if isinstance(obj.get("prompt"), str):
        return ({"role": "user", "content": obj["prompt"]},)
    return ()


def _sharegpt(item: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return _messages(item)
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
    msgs: list[dict[str, str]] = []
    for turn in item["conversations"]:
        if not isinstance(turn, dict):
            continue
        role = roles.get(str(turn.get("from", "")), "user")
        msgs.append({"role": role, "content": str(turn.get("value", ""))})
        if role == "user":
            break
    return tuple(msgs) if msgs and msgs[-1]["role"] == "user" else ()


_QUESTIONS = {
    "en": (
        "Which of the notes above mentions a number? Answer briefly.",
        "Summarise the notes above in one line.",
        "Which note would a historian find most useful, and why?",
    ),
    "zh": ("上面哪条笔记提到了数字？请简短回答。", "用一句话总结上面的笔记。", "哪条笔记对历史学家最有用？为什么？"),
}


def shared_prefix(lengths: Sequence[str] = LENGTHS) -> list[Prompt]:
    """Prompts that share a long system message (the "document") and differ in a short question: what a
    prompt cache or a radix tree serves from memory. Every engine gets the same prompts in the same order,
    so a cache helps each the same way; the cold phase's unique prefix goes into the question, after the
    shared part, so only the question's own tokens are new."""
    prompts: list[Prompt] = []
    for length in lengths:
        if length not in TARGET_TOKENS:
            raise ValueError(f"unknown prompt length {length!r}; choose from {', '.join(ORDER)}")
        for lang in ("en", "zh"):
            doc = _body(lang, TARGET_TOKENS[length])
            for i, q in enumerate(_QUESTIONS[lang]):
                msgs = ({"role": "system", "content": doc}, {"role": "user", "content": q})
                prompts.append(Prompt(f"shared-{lang}-{length}-q{i + 1}", lang, length, msgs))
    return prompts


def load(spec: str, lengths: Sequence[str] = LENGTHS) -> list[Prompt]:
    if spec == "builtin":
        return builtin(lengths)
    if spec == SHARED_PREFIX:
        return shared_prefix(lengths)
    return load_file(spec, lengths)
