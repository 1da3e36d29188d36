"""The benchmark prompt set: building it from held-out source files, and reading it as JSONL.

Three categories, each stressing drafters differently. Every prompt is a window of whole lines that
ends at a line break (the cut); the model continues from there.

  continuation  the cut is between two statements inside a function body, where the next lines
                are fresh code (few of their word 3-grams occur in the prompt);
  copy          the next lines largely repeat the prompt (most of their word 3-grams occur in it):
                test tables, mapping tables, runs of similar calls. Favours n-gram lookup;
  docstring     the cut is inside a multi-line docstring or a block of `#` comments.

Which cut a file contributes is decided by a hash of (file, category, line), so the set is a pure
function of the files and the tokenizer. Files come in sorted order and give at most one prompt per
category per pass over them, so a large repetitive file cannot fill a category on its own.

JSONL: an optional first line {"meta": {...}} saying how the file was built (that key alone; a row
with a prompt is a prompt, a "meta" key of its own ignored), then one object per prompt: {"id",
"category", "source", "line", "tokens" (whole numbers, 0 = unknown), "text"}. A user's own file needs only
"text" per line ("category" defaults to "default"), or, for a chat/instruct target, "messages":
a conversation the target's chat template turns into the prompt, or "input_ids": token ids. The
audit reads its JSONL files through this reader too (row_prompts).

Spec-Bench's question.jsonl reads as it is: a row {"question_id", "category", "turns": [...]}
gives one prompt per user turn. A later turn's conversation holds the earlier turns with the
target's own greedy replies, written once before timing (answer_earlier_turns), so every drafter
and temperature times the same prompts. Spec-Bench's eight MT-bench categories are reported as
its one task "mt_bench" (each prompt keeps its own category in "source").
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ..chat import check_conversation, check_tools
from ..json_lines import json_lines

BUNDLED_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"
CATEGORIES = ("continuation", "copy", "docstring")
# Spec-Bench's speed report groups these categories of its question.jsonl as the task "mt_bench".
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
REPLAY_BATCH = 8  # questions whose earlier turns are answered side by side
BUILD_COMMAND = "draftsman compare --build-prompts {out}"
DEFAULT_CATEGORY = "default"
PROMPT_KEYS = ("text", "messages", "input_ids", "turns")  # a row's prompt, one of them

_WORD = re.compile(r"\w+|[^\w\s]")
COPY_MIN_OVERLAP = 0.7  # share of the continuation's word 3-grams found in the prompt: copy
FRESH_MAX_OVERLAP = 0.4  # at most this share for a continuation prompt: fresh code
LOOKAHEAD_WORDS = 48  # words after the cut that decide copy vs fresh (~ the first 64 new tokens)
PER_FILE = 4  # usable cuts kept per file and category: later rounds over the files take them


@dataclass
class Prompt:
    id: str
    category: str
    source: str = ""  # file the prompt was cut from, relative to the corpus root
    line: int = 0  # 1-based line number of the cut (the first line the model must write)
    tokens: int = 0  # prompt length in the building tokenizer's tokens
    text: str = ""
    messages: list | None = None  # a conversation, rendered by the target's chat template (instead of text)
    tools: list | None = None  # with messages: tool definitions for a tool-calling template
    input_ids: list | None = None  # the prompt as token ids (instead of text)
    # A Spec-Bench row's prompt: the user's turns up to this prompt's one. A later turn's messages
    # stay None until answer_earlier_turns writes the target's replies between them.
    turns: list | None = None


# --------------------------------------------------------------------------- reading / writing

def read_prompts(path: str | Path) -> tuple[list[Prompt], dict]:
    """(prompts, meta) from a JSONL file; errors name the line and what to fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file '{path}' does not exist; build one with "
                                f"`{BUILD_COMMAND.format(out=path)}` or write one JSON object per line "
                                'with a "text" key')
    prompts, meta, seen = [], {}, set()
    lines = json_lines(path.read_text(encoding="utf-8"), str(path), "each line must be one JSON object")
    for row, (n, _, rec) in enumerate(lines):
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object like {{\"text\": \"...\"}}, got {type(rec).__name__}")
        if "meta" in rec and not any(rec.get(key) is not None for key in PROMPT_KEYS):
            # The header: {"meta": {...}} alone, on the first line (write_prompts'). A row holding
            # more is a prompt, its "meta" key ignored; neither is ever dropped unread.
            header = '{"meta": {...}} alone on the first line'
            if set(rec) != {"meta"}:
                raise ValueError(f'{path}:{n}: this row has "meta" and {sorted(set(rec) - {"meta"})} but no prompt: '
                                 f'give it a "text" (or "messages", "input_ids", "turns"); the header is {header}')
            if row > 0:
                raise ValueError(f"{path}:{n}: a second header or one after the prompts; the header is {header}: "
                                 "remove this row, or give it a prompt \"text\"")
            meta = rec["meta"]
            continue
        category = str(rec.get("category") or DEFAULT_CATEGORY)
        default_id = f"{category}-{sum(p.category == category for p in prompts):03d}"
        for prompt in row_prompts(rec, f"{path}:{n}", default_id):
            if prompt.id in seen:
                raise ValueError(f"{path}:{n}: prompt id '{prompt.id}' is used twice; ids must be unique")
            seen.add(prompt.id)
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"prompt file '{path}' holds no prompts")
    return prompts, meta


def row_prompts(rec: dict, where: str, default_id: str) -> list[Prompt]:
    """The prompts of one JSONL row: "text", "messages" (with "tools"), "input_ids" or Spec-Bench's
    "turns" (one prompt per turn). `where` names the row in errors."""
    if rec.get("turns") is not None:
        return turn_prompts(rec, where)
    given = [key for key in ("text", "messages", "input_ids") if rec.get(key) is not None]
    if len(given) > 1:
        raise ValueError(f'{where}: a prompt has one of "text", "messages" or "input_ids"; this one has {given}')
    if rec.get("tools") is not None and given != ["messages"]:
        raise ValueError(f'{where}: "tools" go with "messages", not with "text" or "input_ids"')
    category = str(rec.get("category") or DEFAULT_CATEGORY)
    prompt = Prompt(str(rec.get("id") or default_id), category, str(rec.get("source", "")),
                    _count(rec, "line", where, "the 1-based line of the cut in its source file"),
                    _count(rec, "tokens", where, "the prompt's length in tokens"))
    if given == ["messages"]:
        try:
            prompt.messages = check_conversation(rec["messages"])
        except ValueError as e:
            raise ValueError(f'{where}: "messages": {e}') from None
        try:
            prompt.tools = check_tools(rec.get("tools"))
        except ValueError as e:
            raise ValueError(f'{where}: "tools": {e}') from None
    elif given == ["input_ids"]:
        ids = rec["input_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise ValueError(f'{where}: "input_ids" must be a non-empty list of token ids (integers), '
                             f"got {ids!r}"[:300])
        prompt.input_ids = ids
    elif isinstance(rec.get("text"), str) and rec["text"]:
        prompt.text = rec["text"]
    else:
        raise ValueError(f'{where}: every prompt needs a non-empty string "text" (or "messages": a conversation '
                         'like [{"role": "user", "content": "..."}] for a chat target, "input_ids": token ids, '
                         '"turns": a Spec-Bench question)')
    return [prompt]


def _count(rec: dict, key: str, where: str, meaning: str) -> int:
    """A row's "line" or "tokens": a whole number >= 0 (0 or left out: unknown); a whole float or
    a string of digits reads as its number."""
    value = rec.get(key, 0)
    digits = isinstance(value, str) and value.strip().isascii() and value.strip().isdigit()
    if digits or isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f'{where}: "{key}" must be a whole number >= 0 ({meaning}; 0 = unknown) or left out, '
                         f"got {value!r}"[:300])
    return value


def turn_prompts(rec: dict, where: str) -> list[Prompt]:
    """A Spec-Bench row's prompts, one per user turn: ids "<question_id>", "<question_id>-turn2", ..."""
    turns = rec["turns"]
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns)):
        raise ValueError(f'{where}: "turns" must be a non-empty list of the user\'s messages (strings), as in '
                         f"Spec-Bench's question.jsonl; got {turns!r}"[:300])
    other = [key for key in ("text", "messages", "tools", "input_ids") if rec.get(key) is not None]
    if other:
        raise ValueError(f'{where}: a prompt has "turns" or {other[0]!r}, not both')
    asked = str(rec.get("category") or DEFAULT_CATEGORY)
    category = "mt_bench" if asked in MT_BENCH_CATEGORIES else asked
    qid = rec.get("question_id", rec.get("id"))
    if qid is None:
        raise ValueError(f'{where}: a "turns" row needs its "question_id" (Spec-Bench\'s) or an "id"')
    return [Prompt(str(qid) if k == 1 else f"{qid}-turn{k}", category, asked, turns=turns[:k],
                   messages=[{"role": "user", "content": turns[0]}] if k == 1 else None)
            for k in range(1, len(turns) + 1)]


def answer_earlier_turns(decoder, prompts: list[Prompt], max_new_tokens: int) -> int:
    """Write the conversation of every later-turn prompt: the user's earlier turns, each answered
    by the target's greedy reply of at most max_new_tokens, as Spec-Bench replays a question (whose
    T>0 runs answer with a sample instead). Returns how many replies were generated."""
    from ..training.regenerate import regenerate_batch

    later = [p for p in prompts if p.messages is None and p.turns is not None]
    asked = list(dict.fromkeys(tuple(p.turns) for p in later))
    # One replay per question, through its last turn asked: a shorter list of turns is its prefix.
    replays = [t for t in asked if not any(len(o) > len(t) and o[:len(t)] == t for o in asked)]
    summary = {"replies": 0, "cut_at_max_new_tokens": 0, "kept_as_given": 0, "kept_past_context": 0}
    conversations = []
    for start in range(0, len(replays), REPLAY_BATCH):
        chats = [[m for turn in turns for m in ({"role": "user", "content": turn},
                                                {"role": "assistant", "content": ""})][:-1]
                 for turns in replays[start:start + REPLAY_BATCH]]
        conversations += [c["messages"] for c in regenerate_batch(decoder, chats, max_new_tokens, summary,
                                                                  temperature=0)]
    for p in later:
        k = len(p.turns)
        whole = next(c for turns, c in zip(replays, conversations) if turns[:k] == tuple(p.turns))
        p.messages = whole[:2 * k - 1]
    return summary["replies"]


def write_prompts(path: str | Path, prompts: list[Prompt], meta: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"meta": meta}, ensure_ascii=False)]
    lines += [json.dumps(_record(p), ensure_ascii=False) for p in prompts]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _record(p: Prompt) -> dict:
    """A prompt's JSON object: "text", "messages" or "input_ids", whichever it has."""
    rec = asdict(p)
    del rec["text" if p.messages is not None else "messages"]
    for key in ("tools", "turns", "input_ids"):
        if rec[key] is None:
            del rec[key]
    if p.input_ids is not None:
        del rec["text"]
    return rec


def by_category(prompts: list[Prompt], categories: list[str] | None = None,
                per_category: int | None = None) -> dict[str, list[Prompt]]:
    """{category: prompts} in file order, limited to `categories` (all if None) and to the
    first `per_category` prompts of each."""
    groups: dict[str, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    if categories is not None:
        missing = [c for c in categories if c not in groups]
        if missing:
            raise ValueError(f"categories {missing} have no prompts in the prompt file; it has {sorted(groups)}")
        groups = {c: groups[c] for c in categories}
    if per_category is not None:
        groups = {c: ps[:per_category] for c, ps in groups.items()}
    return groups


# --------------------------------------------------------------------------- building

def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def overlap(context: str, continuation: str, lookahead: int = LOOKAHEAD_WORDS) -> float:
    """Share of the continuation's first word 3-grams that also occur in the context."""
    ctx = _words(context)
    grams = {tuple(ctx[i: i + 3]) for i in range(len(ctx) - 2)}
    nxt = _words(continuation)[:lookahead]
    tests = [tuple(nxt[i: i + 3]) for i in range(len(nxt) - 2)]
    return sum(g in grams for g in tests) / len(tests) if tests else 0.0


def _string_lines(tree: ast.AST) -> set[int]:
    """Lines covered by string constants (a `#` there is not a comment)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.end_lineno:
            out.update(range(node.lineno, node.end_lineno + 1))
    return out


def _candidates(text: str) -> dict[str, list[int]]:
    """Candidate cut lines (1-based: the model writes this line first) per structural category.
    Copy cuts are decided by overlap later, at any line."""
    tree = ast.parse(text)
    body_cuts, doc_cuts = set(), set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body:
            continue
        first = body[0]
        has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                   and isinstance(first.value.value, str))
        if has_doc and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            # Inside the docstring: after its first line, before its closing line.
            doc_cuts.update(range(first.lineno + 1, first.end_lineno))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            stmts = body[1:] if has_doc else body
            for prev, stmt in zip(stmts, stmts[1:]):  # never before the first statement
                if stmt.lineno > prev.end_lineno:  # `a; b` on one line cannot be cut between
                    body_cuts.add(stmt.lineno)
    lines = text.splitlines()
    strings = _string_lines(tree)
    is_comment = [ln.lstrip().startswith("#") and (i + 1) not in strings for i, ln in enumerate(lines)]
    for i in range(1, len(lines)):  # line i+1 continues a comment block of >= 2 lines before it
        if is_comment[i] and is_comment[i - 1] and i >= 2 and is_comment[i - 2]:
            doc_cuts.add(i + 1)
    return {"continuation": sorted(body_cuts), "docstring": sorted(doc_cuts),
            "copy": list(range(2, len(lines) + 1))}


def _window(text: str, starts: list[int], cut_line: int, tokenizer, max_tokens: int) -> tuple[int, int]:
    """(start offset, tokens): whole lines ending at the cut, at most ~4 chars per allowed token,
    then trimmed line by line from the top until they fit in max_tokens tokens."""
    cut = starts[cut_line - 1]
    j = cut_line - 1
    while j > 0 and cut - starts[j - 1] <= 4 * max_tokens:
        j -= 1
    while True:
        n = len(tokenizer(text[starts[j]:cut])["input_ids"])
        if n <= max_tokens or j >= cut_line - 1:
            return starts[j], n
        j += 1


def _rank(source: str, category: str, line: int) -> bytes:
    return hashlib.sha256(f"{source}:{category}:{line}".encode()).digest()


def _file_prompts(text: str, source: str, tokenizer, max_tokens: int, min_tokens: int) -> dict[str, list[Prompt]]:
    """Every usable prompt of one file per category, in hash order (the order they are taken)."""
    try:
        cands = _candidates(text)
    except (SyntaxError, ValueError):  # not Python 3 (lib2to3 test data, ...): skip the file
        return {}
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    out: dict[str, list[Prompt]] = {}
    for category in CATEGORIES:
        found = []
        for line in sorted(cands[category], key=lambda ln: _rank(source, category, ln)):
            if len(found) == PER_FILE:
                break
            cut = starts[line - 1]
            rest = text[cut:]
            if len(_words(rest)) < LOOKAHEAD_WORDS:  # the file must go on for a while
                continue
            # Cheap test first: the real window lies inside these chars, so it overlaps no more.
            if category == "copy" and overlap(text[max(0, cut - 4 * max_tokens):cut], rest) < COPY_MIN_OVERLAP:
                continue
            start, n = _window(text, starts, line, tokenizer, max_tokens)
            if n < min_tokens:
                continue
            share = overlap(text[start:cut], rest)
            if category == "copy" and share < COPY_MIN_OVERLAP:
                continue
            if category == "continuation" and share > FRESH_MAX_OVERLAP:
                continue
            found.append(Prompt("", category, source, line, n, text[start:cut]))
        out[category] = found
    return out


def build_prompts(files: list[Path], tokenizer, per_category: int = 24, max_tokens: int = 256,
                  min_tokens: int = 32, root: Path | None = None) -> list[Prompt]:
    """`per_category` prompts of each category from `files` (sorted), at most one per file per
    round over the files. Raises if the files cannot fill a category."""
    files = sorted(files)
    per_file = []
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        source = path.relative_to(root).as_posix() if root is not None else path.name
        per_file.append(_file_prompts(text, source, tokenizer, max_tokens, min_tokens))
    prompts = []
    for category in CATEGORIES:
        chosen: list[Prompt] = []
        depth = 0
        while len(chosen) < per_category and any(len(f.get(category, [])) > depth for f in per_file):
            for f in per_file:
                if len(chosen) < per_category and len(f.get(category, [])) > depth:
                    chosen.append(f[category][depth])
            depth += 1
        if len(chosen) < per_category:
            raise ValueError(f"the {len(files)} files give only {len(chosen)} '{category}' prompts, "
                             f"{per_category} asked: pass more files or a smaller count")
        for i, p in enumerate(chosen):
            p.id = f"{category}-{i:03d}"
        prompts += chosen
    return prompts


def build_meta(out: str | Path, tokenizer_source: str, per_category: int, max_tokens: int, python: str) -> dict:
    return {
        "built_by": BUILD_COMMAND.format(out=out),
        "corpus": f"held-out split of the Python {python} standard library (draftsman.zoo.heldout_files())",
        "tokenizer": tokenizer_source, "per_category": per_category, "max_prompt_tokens": max_tokens,
        "categories": {
            "continuation": f"cut between statements inside a function body; <= {FRESH_MAX_OVERLAP:.0%} of the "
                            f"next {LOOKAHEAD_WORDS} words' 3-grams occur in the prompt",
            "copy": f">= {COPY_MIN_OVERLAP:.0%} of the next {LOOKAHEAD_WORDS} words' 3-grams occur in the prompt",
            "docstring": "cut inside a multi-line docstring or a block of # comments",
        },
    }
